"""Dahoas reward (`dahoas_reward_model`): GPT-J body + bias-free linear value head, two passes.

Semantics (spec, "Dahoas"): score(text) tokenizes `<|startoftext|>` + text + `<|endoftext|>`,
padded to 550 tokens with pad = eos; the value head runs on every position and the score is the
value at the last position before the first pad (eos) token, or at the last position if there is
none. Reward = score(prompt + completion) - score(completion).

How: causal attention means positions before the first eos never see it or the padding, so each
text is cut just before its first eos and only that is run; each of the two groups of texts runs
its common token prefix once (`prefix.py`). The head is applied to the one chosen row per text.

Weights (the reference's defect: it never loaded them, and unpickled): a folder with a transformers
GPT-J body (`config.json` + safetensors, loaded by `from_pretrained`) and the head as `v_head.weight`
in a safetensors file; or the published layout, a `hf_ckpt.pt` state dict with `transformer.*` and
`v_head.weight`, read with `torch.load(weights_only=True)` into a body built from `base_config`.
Deviations: an eos at the very first token makes the reference read index -1 of the padded row; we
read the input's first token instead (impossible with the real tokenizer: texts start with
`<|startoftext|>`). Texts longer than the model's positions (2048) are cut (status truncated); the
reference did not truncate (its padding is to 550 with truncation off).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rewardstack.config import ModelConfig
from rewardstack.errors import ModelLoadError
from rewardstack._scorers.base import Runtime, ScoreRequest, ScoreResult
from rewardstack._scorers.causal import CausalScorer
from rewardstack._scorers.encoding import head_for_tokens
from rewardstack._scorers.kvcache import choose_path
from rewardstack._scorers.loading import DTYPE_BY_NAME
from rewardstack._memory.manager import Allowance, Pass
from rewardstack._memory.costmodel import PADDING_SLACK
from rewardstack._scorers.prefix import PrefixRunner, model_device, run_in_groups, split_prefix
from rewardstack._models import DAHOAS


def wrap(text: str) -> str:
    """The reference's input text for one score."""
    return "<|startoftext|>" + text + "<|endoftext|>"


def read_position(ids: list[int], eos_id: int | None) -> int:
    """Last position before the first eos (= pad) token, or the last position if none."""
    if eos_id is not None and eos_id in ids:
        return max(0, ids.index(eos_id) - 1)
    return len(ids) - 1


def _local_folder(path: str, revision: str | None) -> Path:
    p = Path(path)
    if p.is_dir():
        return p
    try:  # a hub id: fetch the repository (no code runs; files only)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, revision=revision))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot fetch {path!r}: {e}") from e


def _head_from_safetensors(folder: Path) -> torch.Tensor | None:
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if "v_head.weight" in st.keys():
                return st.get_tensor("v_head.weight")
    return None


def load_dahoas(cfg: ModelConfig, runtime: Runtime) -> tuple[Any, torch.nn.Module, torch.nn.Linear]:
    """(tokenizer, GPT-J body, value head) with the checkpoint's real weights, never unpickled."""
    from transformers import AutoConfig, GPTJModel

    folder = _local_folder(str(cfg.path), cfg.locked.get(str(cfg.path), cfg.revision))  # locked commit first
    base = cfg.options.base_config
    has_tok = (folder / "tokenizer_config.json").exists()
    base_rev = cfg.locked.get(base)  # the lock file pins the base config's hub id too
    tokenizer = runtime.models.tokenizer(str(folder)) if has_tok else runtime.models.tokenizer(base, revision=base_rev)
    if (folder / "config.json").exists():
        body = runtime.models.model(str(folder), GPTJModel, dtype=cfg.dtype)
        head_w = _head_from_safetensors(folder)
        if head_w is None:
            raise ModelLoadError(f"{folder}: no safetensors file holds v_head.weight")
    else:
        ckpts = sorted(folder.glob("*.pt")) + sorted(folder.glob("*.bin"))
        if not ckpts:
            raise ModelLoadError(f"{folder}: neither config.json + safetensors nor a .pt/.bin state dict")
        from accelerate import init_empty_weights

        # Memory-mapped and tensors only (never unpickles code): the tensors stay backed by the file
        # until written. The body is built with its parameters on the meta device and takes them as
        # its parameters (buffers are built normally): no second copy of 12 GB in host memory.
        # Placement moves it; `.to` converts the weights only where the file holds another dtype.
        try:
            state = torch.load(str(ckpts[0]), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # pragma: no cover - legacy (non-zip) files cannot be mapped
            state = torch.load(str(ckpts[0]), map_location="cpu", weights_only=True)
        head_w = state.pop("v_head.weight")
        body_state = {k.removeprefix("transformer."): v for k, v in state.items() if k.startswith("transformer.")}
        with init_empty_weights():
            body = GPTJModel(AutoConfig.from_pretrained(base, revision=base_rev))
        missing, unexpected = body.load_state_dict(body_state, strict=False, assign=True)
        still_meta = [n for n, p in body.named_parameters() if p.device.type == "meta"]
        if unexpected or still_meta:
            raise ModelLoadError(f"{ckpts[0]}: missing {sorted(set(missing) | set(still_meta))[:5]}, "
                                 f"unexpected {unexpected[:5]}")
        body = body.to(DTYPE_BY_NAME[cfg.dtype]).eval().requires_grad_(False)
    head = torch.nn.Linear(head_w.shape[1], 1, bias=False)
    head.weight.data.copy_(head_w.reshape(1, -1))
    head = head.to(device=model_device(body), dtype=next(body.parameters()).dtype).eval().requires_grad_(False)
    return tokenizer, body, head


class DahoasScorer(CausalScorer):
    """GPT-J value model; reward is the score with the prompt minus the score without it."""

    name = DAHOAS.name

    def __init__(self, cfg: ModelConfig, runtime: Runtime) -> None:
        super().__init__(cfg, runtime)
        self.tokenizer, self.body, self.head = load_dahoas(cfg, runtime)
        self.eos_id = self.tokenizer.eos_token_id
        self.fill_id = int(self.eos_id if self.eos_id is not None else 0)
        self.max_len = int(cfg.max_length or getattr(self.body.config, "n_positions", 2048))
        self.vocab = int(self.body.config.vocab_size)
        self.use_prefix = choose_path(self.name, self.body, self.vocab, wanted=cfg.options.shared_prefix)
        # Not profiled after a shared prefix: a step's two groups of texts share different prefixes,
        # and `memory.run` is told neither.
        self._calibrate(max_batch=4)

    def modules(self) -> list[torch.nn.Module]:
        return [self.body, self.head]

    def _score_live(self, request: ScoreRequest, live: list[int], res: ScoreResult) -> ScoreResult:
        comps = [request.completions[i] for i in live]
        n = len(live)
        cut = [False] * (2 * n)

        def inputs(allowance: Allowance) -> Pass:
            """Both groups of texts, tokenized within what the budget allows."""
            cap = min(self.max_len, allowance.cap)

            # Only the first `cap` ids count: read a head that provably gives them (encoding.py, head_for_tokens).
            texts = [request.prompt + c for c in comps] + comps  # type: ignore[operator]
            texts = [wrap(head_for_tokens(t, self.tokenizer, cap)) for t in texts]
            ids: list[list[int]] = []
            for k, x in enumerate(self.tokenizer(texts).input_ids):
                x = x[: read_position(x, self.eos_id) + 1]  # positions after it cannot change its value
                cut[k] = len(x) > cap
                ids.append(x[:cap])
            # With-prompt texts share more than without: each group runs its own prefix.
            runners = [PrefixRunner(self.body, split_prefix(group, self.use_prefix)[0], pad_id=self.fill_id)
                       for group in (ids[:n], ids[n:])]
            lengths = [len(x) for x in ids]

            def forward(batch: list[int]) -> list[float]:
                out: dict[int, float] = {}
                for part, runner in enumerate(runners):
                    sel = [j for j in batch if (j >= n) == bool(part)]
                    out.update(zip(sel, run_in_groups(sel, lengths, lambda js: self._forward(runner, [ids[j] for j in js]))))
                return [out[j] for j in batch]

            return Pass(lengths, forward, max_batch=self.max_batch, slack=PADDING_SLACK,
                        prepare=lambda: [r.state() for r in runners], completions=live + live)

        outcomes = self.runtime.memory.run_pass(self.name, inputs, upper=self.max_len)
        # Each completion's two runs: with the prompt (first n), alone (next n); reward = the difference.
        return self._fill(res, live, outcomes, lambda a, b: float(a) - float(b), parts=2,
                          cut=[cut[k] or cut[n + k] for k in range(n)])


build = DahoasScorer
"""The registry's builder: the Dahoas scorer for a folder or hub id holding body + value head weights."""
