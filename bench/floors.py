"""Forward-pass floors: the least work each scorer's semantics need, timed alone.

A floor runs only the model passes (pre-tokenized, inputs at their bounds, each text once, a shared
prefix once, batched and sorted by length), with no tokenization, no bookkeeping and no tracker.
Every benchmark that reports "vs floor" takes its floor from here, so the figures agree.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from bench.common import timed
from rewardstack._scorers import classifier, embedding
from rewardstack._scorers import encoding as enc
from rewardstack._scorers.prefix import PrefixRunner, padding_groups, split_prefix
from rewardstack.stack import Step

BTLM_RATIO = 50257 * 2560 / (32 * 12 * 2560**2)
"""Head MACs per scored row over body MACs per token for BTLM-3B-8k (vocab 50257, hidden 2560, 32 layers)."""


def live(step: Step) -> list[str]:
    """The completions of a step that did not fail."""
    return [c for c in step.completions if c is not None]


def forward_rows(model: torch.nn.Module, rows: list[list[int]], pad_id: int, head: Callable) -> float:
    """Seconds of the faster schedule over pre-tokenized rows (forward passes only).

    Schedules: length-sorted groups with <= 25% padding, or one-window passes of <= 512 tokens.
    """
    if not rows:
        return 0.0
    lengths = [len(r) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: lengths[i])
    window = max(lengths)
    schedules = [padding_groups(lengths), enc.token_groups(order, lengths, max(512, min(window, 512)))]
    batches = [[enc.pad_batch(model, [rows[i] for i in g], pad_id) for g in s] for s in schedules]
    best = float("inf")
    for sched in batches:
        with torch.inference_mode():
            best = min(best, timed(lambda: [head(model(**b), b["attention_mask"]) for b in sched]))
    return best


def floor_body(body: torch.nn.Module, groups_of_ids: list[list[list[int]]]) -> None:
    """Decoder floor: per group, the common prefix once, each input's remaining tokens attending to it.

    (Every input alone, batch 1, with no padding at all, measured within 4% of this on the
    proportioned stand-in and slower on the tiny one: the padding groups do not inflate it.)
    """
    with torch.inference_mode():
        for ids in groups_of_ids:
            prefix, _ = split_prefix(ids)
            runner = PrefixRunner(body, prefix)
            for grp in padding_groups([len(x) for x in ids]):
                runner.run([ids[k][len(prefix):] for k in grp])


def head_matmul(head: Any, n_rows: int, chunk: int) -> float:
    """Seconds for a DPO head over `n_rows` hidden rows: the projection to vocabulary logits and
    their log-sum-exp (one exp and one sum per logit), nothing else.

    Both are work the semantics cannot skip: a row's log-probability is its token's logit minus
    the log-sum-exp over the whole vocabulary. The cost does not depend on the values, so random
    rows stand in for the body's; they go through the scorer's own head into one reused buffer of
    its chunk size (its fastest way), and the exp and sum run in place on that buffer.
    """
    g = torch.Generator().manual_seed(0)
    h = torch.randn(min(n_rows, 4 * chunk), head.weight.shape[1], generator=g)
    h.mul_(1e-3)  # keep exp() finite: the cost of exp does not depend on the values
    buf = torch.empty(chunk, head.vocab)
    t = time.perf_counter()
    with torch.inference_mode():
        done = 0
        while done < n_rows:
            r = min(chunk, n_rows - done)
            k = done % h.shape[0]
            k = 0 if k + r > h.shape[0] else k
            head(h[k : k + r], buf[:r])
            buf[:r].exp_().sum(1).log_()
            done += r
    return time.perf_counter() - t


def work_ratio(config: Any) -> float:
    """Head MACs per scored row over body MACs per token (GPT-2 block: 12 H^2, attention aside)."""
    return config.vocab_size * config.n_embd / (config.n_layer * 12 * config.n_embd**2)


# -- per scorer ---------------------------------------------------------------------------------

def openassistant_rows(sc: Any, step: Step) -> list[list[int]]:
    """The pairs OpenAssistant runs, cut to its bound."""
    return sc.encode(step.prompt, live(step), sc.max_length)[0]


def openassistant(sc: Any, steps: list[Step]) -> float:
    """OpenAssistant: every (prompt, completion) pair once, at its bound."""
    return forward_rows(sc.model, [r for s in steps for r in openassistant_rows(sc, s)], sc.pad_id, classifier.first_logit)


def nsfw_windows(sc: Any, step: Step) -> list[list[int]]:
    """Every 512-id window of every completion."""
    ids = sc.tokenizer(live(step))["input_ids"] if live(step) else []
    return [x[i : i + sc.window] for x in ids for i in range(0, len(x), sc.window)]


def nsfw(sc: Any, steps: list[Step]) -> float:
    """NSFW: every window once."""
    return forward_rows(sc.model, [w for s in steps for w in nsfw_windows(sc, s)], sc.pad_id, classifier.hate_value)


def embedding_rows(rel: Any, steps: list[Step], cache: Any) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(BERT rows, MPNet rows for relevance, MPNet rows for diversity); each text embedded once.

    Relevance: BERT windows of the base prompt and each completion, MPNet over the base prompt and
    the completions that pass model 1; diversity: MPNet over the completions relevance did not
    already embed (the checkpoint is shared). `cache` (the runtime's embedding cache) is cleared
    after deciding what passes model 1.
    """
    t1, t2 = rel.first.tokenizer, rel.second.tokenizer
    b1 = rel.bounds[0]
    passing: dict[int, list[str]] = {}
    for s in steps:  # which completions reach model 2
        (p, _), *es = rel.first.embed([s.base_prompt or s.prompt] + live(s))
        passing[id(s)] = [c for c, (e, _) in zip(live(s), es) if -float(((e - p) ** 2).mean().sqrt()) >= b1]
    cache.clear()

    def mpnet(texts: list[str]) -> list[list[int]]:
        return t2(texts, truncation=True, max_length=rel.second.max_length)["input_ids"] if texts else []

    bert = [r for s in steps for r in t1([s.base_prompt or s.prompt] + live(s), truncation=True,
                                         max_length=rel.first.max_length, return_overflowing_tokens=True)["input_ids"]]
    rel2 = [r for s in steps for r in mpnet([s.base_prompt or s.prompt] + passing[id(s)])]
    div = [r for s in steps for r in mpnet([c for c in live(s) if c not in passing[id(s)]])]
    return bert, rel2, div


def embeddings(rel: Any, steps: list[Step], cache: Any) -> tuple[float, float]:
    """(relevance, diversity) floor seconds over `embedding_rows`."""
    bert, rel2, div = embedding_rows(rel, steps, cache)
    m1, m2, pooled = rel.first.model, rel.second.model, embedding.pooled
    f_rel = forward_rows(m1, bert, rel.first.pad_id, pooled) + forward_rows(m2, rel2, rel.second.pad_id, pooled)
    return f_rel, forward_rows(m2, div, rel.second.pad_id, pooled)


def reciprocate_groups(sc: Any, steps: list[Step]) -> list[list[list[int]]]:
    """Reciprocate's templated inputs, cut to its bound, one group per step."""
    from rewardstack._scorers import reciprocate

    fmt = reciprocate.TEMPLATE.format
    return [reciprocate.tokenize_bounded(sc.tokenizer, [fmt(prompt=s.prompt, completion=c) for c in live(s)], sc.max_len)[0]
            for s in steps]


def reciprocate_floor(sc: Any, steps: list[Step]) -> float:
    """Reciprocate: the step's common prefix once plus each input's remaining tokens."""
    groups = reciprocate_groups(sc, steps)
    return timed(lambda: floor_body(sc.body, groups))


def dpo_inputs(sc: Any, steps: list[Step]) -> tuple[list[list[list[int]]], int]:
    """DPO's inputs as the scorer runs them (cut to max_len, short completions skipped) and the
    number of completion rows the head must project."""
    tok = sc.tokenizer
    groups, n_rows = [], 0
    for s in steps:
        p = len(tok(s.prompt).input_ids)
        cs = [c for c in live(s) if len(c) > 5]
        ids = [x[: sc.max_len] for x in tok([s.prompt + c for c in cs]).input_ids] if cs else []
        groups.append(ids)
        n_rows += sum(max(0, len(x) - p) for x in ids)
    return groups, n_rows


def dpo(sc: Any, steps: list[Step]) -> tuple[float, float]:
    """DPO: (body floor, head over the scored rows: matmul and log-sum-exp); exact semantics need both."""
    groups, n_rows = dpo_inputs(sc, steps)
    t_body = timed(lambda: floor_body(sc.body, groups))
    return t_body, head_matmul(sc.logit_head, n_rows, sc.chunks.chunk)


def static_batches(model: torch.nn.Module, rows: list[list[int]], pad_id: int, batch: int) -> tuple[float, list[float]]:
    """The plain forward over pre-tokenized `rows` sorted by length into static batches of `batch`
    rows (right padding): its seconds, and each row's first logit in the order given. The trainer
    routes' floor (`bench.trainer_floor`): what serving a sequence-classification reward model must
    at least spend, with no server, tokenizer or scheduler around it."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    batches = []
    for k in range(0, len(order), batch):
        group = order[k:k + batch]
        width = max(len(rows[i]) for i in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for j, i in enumerate(group):
            ids[j, :len(rows[i])] = torch.tensor(rows[i])
            mask[j, :len(rows[i])] = 1
        batches.append((group, ids, mask))
    scores = [0.0] * len(rows)
    t = time.perf_counter()
    with torch.inference_mode():
        outs = [model(input_ids=ids, attention_mask=mask).logits[:, 0] for _, ids, mask in batches]
    seconds = time.perf_counter() - t
    for (group, _, _), out in zip(batches, outs):
        for i, v in zip(group, out.tolist()):
            scores[i] = v
    return seconds, scores
