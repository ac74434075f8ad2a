"""Hostile input to `score`, the library and the service: every bad line named, bounded work, no double count.

One test per defect of issue 22 (bad UTF-8, deep nesting in the reader and the event writer, deep
nesting at the service, `max_namespaces` under concurrency, the journal of another output, work per
input, retries with other uids and untyped fields), on the fake scorers.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from fakes import text_score
from rewardstack import _runner as runner
from rewardstack.cli import main
from rewardstack._fileio import event_line, jsonable as _jsonable
from rewardstack.config import from_dict
from rewardstack.errors import InputError
from rewardstack._service.errors import ServiceError
from rewardstack.stack import RewardStack, Step
from rewardstack._state import StateStore


def _config(tmp_path: Path, extra: str = "") -> Path:
    p = tmp_path / "stack.toml"
    p.write_text(f'device = "cpu"\nstate_dir = "state"\n{extra}')
    return p


def _line(tag: str, n: int = 4) -> bytes:
    return json.dumps({"name": "augment", "prompt": f"prompt {tag}", "completions": [f"{tag} {j}" for j in range(n)]}).encode()


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# -- 1. bytes that are not UTF-8 ----------------------------------------------------------------

def test_a_line_of_bad_utf8_is_that_lines_error_and_the_others_are_scored(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    steps = tmp_path / "steps.jsonl"
    bad = b'{"name": "augment", "prompt": "p", "completions": ["\xff\xfe"]}'
    steps.write_bytes(_line("a") + b"\n" + bad + b"\n" + _line("b") + b"\n")
    out = tmp_path / "ev.jsonl"
    assert main(["score", "--config", str(_config(tmp_path)), "--input", str(steps), "--output", str(out)]) == 2
    assert [e["prompt"] for e in _events(out)] == ["prompt a", "prompt b"]
    err = capsys.readouterr().err
    assert "line 2: not valid UTF-8 (byte 0xff" in err


def test_a_byte_order_mark_at_the_start_of_the_file_is_skipped_and_said_once(tmp_path: Path, fake_registry, caplog) -> None:  # noqa: ANN001
    """Issue 33 #9: a UTF-8 BOM (as Windows editors write) lost the valid first step (rc 2)."""
    steps = tmp_path / "steps.jsonl"
    steps.write_bytes(b"\xef\xbb\xbf" + _line("a") + b"\n" + _line("b") + b"\n")
    out = tmp_path / "ev.jsonl"
    with caplog.at_level("WARNING"):
        assert main(["score", "--config", str(_config(tmp_path)), "--input", str(steps), "--output", str(out)]) == 0
    assert [e["prompt"] for e in _events(out)] == ["prompt a", "prompt b"]
    said = [r for r in caplog.records if "byte order mark" in r.getMessage()]
    assert len(said) == 1 and "line 1" in said[0].getMessage(), [r.getMessage() for r in caplog.records]


# -- 2. deep nesting: the reader and the event writer ---------------------------------------------

def test_deeply_nested_lines_are_named_and_never_poison_a_rerun(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    steps = tmp_path / "steps.jsonl"
    deep_doc = _nested(990).encode()  # raised RecursionError in the reader
    deep_field = ('{"name": "augment", "prompt": "p", "completions": ["x y"], "set_weights": %s}' % _nested(900)).encode()
    steps.write_bytes(b"\n".join([_line("a"), deep_doc, deep_field, _line("b")]) + b"\n")
    cfg, out = _config(tmp_path), tmp_path / "ev.jsonl"
    assert main(["score", "--config", str(cfg), "--input", str(steps), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "line 2: nested deeper than 64 levels" in err and "line 3: nested deeper than 64 levels" in err
    assert [e["prompt"] for e in _events(out)] == ["prompt a", "prompt b"]
    assert main(["score", "--config", str(cfg), "--input", str(steps), "--output", str(out)]) == 2  # a rerun resumes
    assert len(_events(out)) == 2


def test_the_event_writers_conversion_is_not_recursive() -> None:
    deep: list = []
    inner = deep
    for _ in range(20_000):
        inner.append([])
        inner = inner[0]
    inner.append(float("nan"))
    out = _jsonable({"set_weights": deep, "x": [1.0, float("inf")]})  # RecursionError before
    assert out["x"] == [1.0, None]
    for _ in range(20_001):
        out = out["set_weights"] if isinstance(out, dict) else out[0]
    assert out == [None]
    assert event_line({"a": (1, float("nan")), "b": {"c": [float("-inf")]}}) == '{"a": [1, null], "b": {"c": [null]}}\n'


# -- 3, 4, 7. the service, in process ------------------------------------------------------------

@pytest.fixture
def service(fake_config):  # noqa: ANN001, ANN201
    """The FastAPI app over a started worker on the fake scorers, and a function that POSTs to it."""
    pytest.importorskip("fastapi")
    import httpx

    from rewardstack._service.app import create_app
    from rewardstack._service.access import Access
    from rewardstack._service.worker import Worker

    settings = fake_config.service
    settings.max_namespaces = 3
    settings.max_chars = 4000
    settings.max_completions = 8
    worker = Worker(fake_config, queue_size=64, batch_requests=16, max_namespaces=settings.max_namespaces)
    worker.start()
    deadline = time.monotonic() + 60
    while not worker.ready and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.ready, worker.error
    app = create_app(fake_config, settings, Access({}), worker=worker)

    async def post_all(bodies: list[bytes | dict]) -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a 500 is an answer here
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await asyncio.gather(*[
                client.post("/v1/score", content=b if isinstance(b, bytes) else json.dumps(b).encode(),
                            headers={"content-type": "application/json"}) for b in bodies])

    def post(*bodies: bytes | dict):  # noqa: ANN202
        return asyncio.run(post_all(list(bodies)))

    post.worker = worker  # type: ignore[attr-defined]
    try:
        yield post
    finally:
        worker.begin_drain()
        worker.join(30)


def _step(tag: str, **extra: object) -> dict:
    return {"name": "augment", "prompt": f"prompt {tag}", "completions": [f"{tag} one", f"{tag} two"], **extra}


def test_deep_nesting_at_the_service_is_400_not_500(service) -> None:  # noqa: ANN001
    body = ('{"name": "augment", "prompt": "p", "completions": ["x"], "set_weights": %s}' % _nested(5000)).encode()
    for b in (body, _nested(100).encode(), b'{"a": ' * 3000 + b"1" + b"}" * 3000):
        (r,) = service(b)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_json" and "nested deeper" in r.json()["error"]["message"]
    (ok,) = service(_step("after"))  # the service still scores
    assert ok.status_code == 200


def test_max_namespaces_holds_for_concurrent_first_requests(service, fake_config) -> None:  # noqa: ANN001
    answers = service(*[_step(f"n{k}", namespace=f"ns{k}") for k in range(8)])
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] * 3 + [403] * 5, [r.text for r in answers]
    assert all(r.json()["error"]["type"] == "namespace_limit" for r in answers if r.status_code == 403)
    root = Path(fake_config.state_dir) / "namespaces"
    assert len([p for p in root.iterdir() if p.is_dir()]) == 3


def test_a_refused_request_creates_no_namespace(service, fake_config) -> None:  # noqa: ANN001
    """Issue 33 #8: refusals for new namespaces (a sequence gap, a resent old number) left their
    folders behind and used up `max_namespaces` (3 here)."""
    refused = service(*[_step(f"g{k}", namespace=f"gap{k}", sequence=5) for k in range(3)])
    assert [r.status_code for r in refused] == [409] * 3, [r.text for r in refused]
    root = Path(fake_config.state_dir) / "namespaces"
    assert not root.is_dir() or not [p for p in root.iterdir() if p.is_dir()]
    answers = service(*[_step(f"k{k}", namespace=f"kept{k}") for k in range(3)])
    assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]


def test_a_new_namespace_whose_only_step_failed_leaves_nothing(fake_config, monkeypatch) -> None:  # noqa: ANN001
    """Issue 33 #8: a step that fails (500) in a new namespace does not keep the namespace's slot."""
    from rewardstack._service.worker import Job, Worker

    worker = Worker(fake_config, queue_size=8, batch_requests=8, max_namespaces=1)
    worker.stack = RewardStack(fake_config, load_state=False)
    worker.ready = True
    job = Job("lost", Step.from_dict(_step("f")), None, deadline=time.monotonic() + 60)
    with monkeypatch.context() as m:
        m.setattr(worker.stack, "forward_many", lambda steps: (_ for _ in ()).throw(RuntimeError("boom")))
        worker.submit(job)
        worker._process(worker._take())
    with pytest.raises(ServiceError) as e:
        job.future.result(timeout=0)
    assert e.value.status == 500 and worker.namespaces.peek("lost") is None
    assert not worker.namespaces.loaded() and not worker.namespaces.on_disk()
    ok = Job("other", Step.from_dict(_step("o")), None, deadline=time.monotonic() + 60)
    worker.submit(ok)
    worker._process(worker._take())
    assert ok.future.result(timeout=0).sequence == 1  # the one slot is still free


def test_a_retry_with_other_uids_is_a_conflict(service) -> None:  # noqa: ANN001
    (first,) = service(_step("u", sequence=1, uids=[5, 6]))
    assert first.status_code == 200
    (same,) = service(_step("u", sequence=1, uids=[5, 6]))
    assert same.status_code == 200 and same.headers["X-Rewardstack-Scored"] == "false"
    (other,) = service(_step("u", sequence=1, uids=[7, 8]))
    assert other.status_code == 409 and other.json()["error"]["type"] == "sequence_conflict"
    (block,) = service(_step("u", sequence=1, uids=[5, 6], block=9))
    assert block.status_code == 409


def test_a_retry_is_compared_with_the_whole_step_as_committed(service) -> None:  # noqa: ANN001
    """Issue 33 #6: a failed completion resent as empty, another base prompt or another
    new_forward_pass is another step (409), though the event echoes none of those differences."""
    first = _step("w", sequence=1, completions=[None, "w two"], base_prompt="base w")
    (r,) = service(first)
    assert r.status_code == 200
    (same,) = service(first)
    assert same.status_code == 200 and same.headers["X-Rewardstack-Scored"] == "false" and same.content == r.content
    for changed in ({**first, "completions": ["", "w two"]}, {**first, "base_prompt": "another base"},
                    {**first, "new_forward_pass": False}):
        (other,) = service(changed)
        assert other.status_code == 409 and other.json()["error"]["type"] == "sequence_conflict", changed
    # Two copies racing in one turn are compared the same way.
    second = _step("w2", sequence=2, completions=[None, "x"])
    a, b = service(second, {**second, "completions": ["", "x"]})
    assert sorted([a.status_code, b.status_code]) == [200, 409], (a.text, b.text)


@pytest.mark.parametrize("field,value", [
    ("block", float("-inf")), ("block", -1), ("block", 1.5), ("block", True), ("block", "12"),
    ("gating_loss", "0.1"), ("gating_loss", False), ("set_weights", {"w": 1}), ("set_weights", "all"),
    ("set_weights", [[[1.0]]]), ("name", "followups"), ("name", "bogus"), ("name", ""),
])
def test_fields_are_type_checked(field: str, value: object) -> None:
    d = _step("t", **{field: value})
    with pytest.raises(InputError) as e:
        Step.from_dict(d)
    assert e.value.field == field


def test_valid_optional_fields_pass() -> None:
    for name in ("augment", "followup0", "answer3", "followup", "answer"):
        Step.from_dict(_step("t", name=name, block=0, gating_loss=float("nan"), set_weights=[[0.5, 1], [True]]))


# -- 5. the journal of another output ------------------------------------------------------------

def test_the_journal_of_another_output_is_settled_before_scoring_this_one(tmp_path: Path, fake_registry, monkeypatch) -> None:  # noqa: ANN001
    cfg = _config(tmp_path)
    a_in, b_in = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a_in.write_bytes(b"\n".join(_line(f"a{k}", 5) for k in range(4)) + b"\n")
    b_in.write_bytes(b"\n".join(_line(f"b{k}", 5) for k in range(3)) + b"\n")
    a_out, b_out = tmp_path / "a.out", tmp_path / "b.out"
    real_append = runner._append
    calls = {"n": 0}

    def dies_after_state_save(path: Path, lines: list[str]) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # the state holds step 3 of A; its line never reached a.out
        real_append(path, lines)

    monkeypatch.setattr(runner, "_append", dies_after_state_save)
    # the command line reports the interrupt in one line and exits 130 (rewardstack._cli_errors)
    assert main(["score", "--config", str(cfg), "--input", str(a_in), "--output", str(a_out)]) == 130
    monkeypatch.setattr(runner, "_append", real_append)
    assert len(_events(a_out)) == 2
    assert main(["score", "--config", str(cfg), "--input", str(b_in), "--output", str(b_out)]) == 0
    assert len(_events(a_out)) == 3  # A's committed step was written to A's output first
    assert main(["score", "--config", str(cfg), "--input", str(a_in), "--output", str(a_out)]) == 0
    assert [e["prompt"] for e in _events(a_out)] == [f"prompt a{k}" for k in range(4)]
    sections = StateStore(tmp_path / "state").load()
    assert sections["stack"]["steps_scored"] == 7  # 4 + 3, none twice
    assert sections["normalizers"]["rlhf_reward_model"]["count"] == 35  # 7 steps x 5 completions


def test_a_journal_whose_output_is_gone_refuses_another_input(tmp_path: Path, fake_registry, monkeypatch, capsys) -> None:  # noqa: ANN001
    cfg = _config(tmp_path)
    a_in, b_in = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a_in.write_bytes(b"\n".join(_line(f"a{k}") for k in range(3)) + b"\n")
    b_in.write_bytes(_line("b") + b"\n")
    a_out = tmp_path / "a.out"
    real_append = runner._append
    calls = {"n": 0}

    def dies(path: Path, lines: list[str]) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        real_append(path, lines)

    monkeypatch.setattr(runner, "_append", dies)
    # the command line reports the interrupt in one line and exits 130 (rewardstack._cli_errors)
    assert main(["score", "--config", str(cfg), "--input", str(a_in), "--output", str(a_out)]) == 130
    monkeypatch.setattr(runner, "_append", real_append)
    a_out.unlink()
    assert main(["score", "--config", str(cfg), "--input", str(b_in), "--output", str(tmp_path / "b.out")]) == 1
    err = capsys.readouterr().err
    assert f"belongs to {a_out.resolve()}" in err and "before scoring another input" in err
    assert StateStore(tmp_path / "state").load()["stack"]["steps_scored"] == 2  # nothing scored


# -- 6. bounded work per input ------------------------------------------------------------------

def test_a_text_past_max_chars_is_cut_before_the_models_and_says_so(tmp_path: Path, fake_registry) -> None:  # noqa: ANN001
    cfg = from_dict({"device": "cpu", "state_dir": str(tmp_path / "state"), "input": {"max_chars": 1000}})
    stack = RewardStack(cfg, load_state=False)
    long = "word " * 5000
    result = stack.score_step({"name": "augment", "prompt": "p", "completions": ["short one", long.strip(), None]}, save=False)
    assert result.statuses == ["ok", "cut", "failed"]
    # Every model read the cut text (the blacklist compares whole strings in the stateful part: no model).
    assert {m: s[1] for m, s in result.model_statuses.items() if m != "blacklist_filter"} == \
        {m: "cut" for m in result.model_statuses if m != "blacklist_filter"}
    # The model read exactly the first 1000 characters (the fakes score a hash of what they read).
    assert result.raw["rlhf_reward_model"][1] == text_score("rlhf_reward_model", long.strip()[:1000])
    assert result.event["completions"][1] == long.strip()[:1000]  # the event echoes what was read, no more
    cut_prompt = stack.score_step({"name": "augment", "prompt": "q" * 1001, "completions": ["a b", "c d"]}, save=False)
    assert cut_prompt.statuses == ["cut", "cut"]


def test_too_many_completions_is_a_bad_line(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    steps = tmp_path / "steps.jsonl"
    steps.write_bytes(_line("many", 12) + b"\n" + _line("few", 3) + b"\n")
    out = tmp_path / "ev.jsonl"
    code = main(["score", "--config", str(_config(tmp_path)), "--input", str(steps), "--output", str(out),
                 "--max-completions", "10", "--max-chars", "50"])
    assert code == 2
    assert "line 1, field 'completions': 12 completions, more than 10" in capsys.readouterr().err
    assert [e["prompt"] for e in _events(out)] == ["prompt few"]


def test_the_library_refuses_too_many_completions(fake_config) -> None:  # noqa: ANN001
    fake_config.input.max_completions = 2
    stack = RewardStack(fake_config, load_state=False)
    with pytest.raises(InputError, match="more than 2"):
        stack.score_step(Step.from_dict(_step("x", completions=["a", "b", "c"])), save=False)


def test_service_error_type_is_unchanged_for_limits() -> None:
    from rewardstack._service.protocol import parse_score
    from rewardstack._settings import InputSettings, ServiceSettings

    with pytest.raises(ServiceError) as e:
        parse_score(json.dumps(_step("x", completions=["a"] * 5)).encode(), None, ServiceSettings(),
                    InputSettings(max_completions=4))
    assert e.value.status == 413 and e.value.type == "too_many_completions"


def test_the_ray_state_actor_also_refuses_a_retry_with_other_uids(fake_config, tmp_path: Path) -> None:  # noqa: ANN001
    pytest.importorskip("ray")
    from rewardstack._distributed.serve import NamespaceState

    actor = NamespaceState(fake_config, "alpha", str(tmp_path / "ray-state"))  # the class, in process
    stack = RewardStack(fake_config, load_state=False)
    step = Step.from_dict(_step("r", uids=[1, 2]))
    first = asyncio.run(actor.commit(1, None, stack.forward(step), 1.0))
    assert first.scored is True
    assert asyncio.run(actor.precheck(1, None, step)).body == first.body
    other = Step.from_dict(_step("r", uids=[3, 4]))

    def conflict(reply: object) -> bool:
        return isinstance(reply, ServiceError) and (reply.status, reply.type) == (409, "sequence_conflict")

    assert conflict(asyncio.run(actor.precheck(1, None, other)))
    assert conflict(asyncio.run(actor.commit(1, None, stack.forward(other), 1.0)))
    empty = Step.from_dict(_step("r", uids=[1, 2], completions=["", "r two"]))  # issue 33 #6: failed is not empty
    failed = Step.from_dict(_step("r", uids=[1, 2], completions=[None, "r two"]))
    assert asyncio.run(actor.commit(2, None, stack.forward(failed), 1.0)).scored is True
    assert conflict(asyncio.run(actor.precheck(2, None, empty)))
    actor.ns.lock.release()
