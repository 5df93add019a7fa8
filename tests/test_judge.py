"""Elegance judge: the strict verdict parser, templates, the OpenAI-compatible HTTP judge against a
real local server (retries, timeouts, concurrency, cache, the API key never leaking), the
EleganceVerifier's rewards and labels (with a stand-in and with the real MathVerifier), and a
tiny local transformers judge in generate and score mode."""

from __future__ import annotations

import logging
import pickle
import socket
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from judge_standin import StandinJudge

from tandem_lit.errors import ConfigError, DataError
from tandem_lit.verifiers.base import Grade, MissingColumnError, Verifier, label_means
from tandem_lit.verifiers.elegance import EleganceVerifier
from tandem_lit.verifiers.judge import (
    HTTPJudge,
    Judge,
    JudgeAuthError,
    JudgeUnavailableError,
    TransformersJudge,
    load_template,
    parse_verdict,
    render,
)

KEY_ENV = "TANDEM_TEST_JUDGE_KEY"
SECRET = "sk-test-5ecret-0123456789abcdef"
PROBLEM = "How many subsets of {1, ..., 10} have an even sum?"


class BoxedVerifier(Verifier):
    """Correct when the completion contains \\boxed{answer}; reward 1. Counts grades as 'timeouts'
    to show EleganceVerifier passes its inner verifier's counter through."""

    required_columns = ("answer",)

    def __init__(self):
        self.timeouts = 0

    def grade(self, completion, answer=None, **columns):
        correct = f"\\boxed{{{answer}}}" in completion
        return Grade(correct=correct, reward=float(correct), labels={"inner": 1.0})


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    return SECRET


@pytest.fixture
def server(key):
    with StandinJudge(key) as standin:
        yield standin


def http_judge(server, **overrides) -> HTTPJudge:
    settings = dict(base_url=server.base_url, model="standin", api_key_env=KEY_ENV, backoff_s=0.01, timeout_s=5.0)
    return HTTPJudge(**{**settings, **overrides})


def rows(*completions_and_answers):
    completions = [c for c, _ in completions_and_answers]
    return completions, {"answer": [a for _, a in completions_and_answers], "problem": [PROBLEM] * len(completions)}


# -- the verdict parser -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("VERDICT: ELEGANT", True),
        ("VERDICT: BASHY", False),
        ("A symmetry pairs the subsets.\n\nVERDICT: ELEGANT\n", True),
        ("Casework on the last digit.\n   VERDICT: BASHY   \n\n", False),
        ("<think>maybe VERDICT: BASHY?\nVERDICT: BASHY</think>\nShort argument.\nVERDICT: ELEGANT", True),
        ("", None),
        ("It is elegant.", None),  # no verdict line
        ("VERDICT: ELEGANT\nVERDICT: BASHY", None),  # both
        ("VERDICT: ELEGANT\nVERDICT: ELEGANT", None),  # two verdict lines, even if they agree
        ("VERDICT: ELEGANT\nThat is my answer.", None),  # text after the verdict
        ("VERDICT: elegant", None),  # wrong case
        ("**VERDICT: ELEGANT**", None),  # markup
        ("Verdict: ELEGANT", None),
        ("VERDICT: ELEGANT.", None),
        ("VERDICT:ELEGANT", None),
        ("VERDICT: MAYBE", None),
        ("The verdict is clear.\nVERDICT: ELEGANT", True),  # only lines *starting* with "verdict" count
        ("Verdict first: unsure.\nVERDICT: ELEGANT", None),  # another line starting with "verdict"
        ("I think ELEGANT", None),
        ("<think>VERDICT: ELEGANT", None),  # reasoning cut off before it closed
    ],
)
def test_parse_verdict_examples(reply, expected):
    assert parse_verdict(reply) is expected


# Reasoning text whose lines never start with the word "verdict".
reasoning = st.lists(
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Zl", "Zp", "Cc")), max_size=40).filter(
        lambda line: not line.strip(" *#>-_").lower().startswith("verdict") and "<think>" not in line
    ),
    max_size=5,
).map("\n".join)


@settings(max_examples=200, deadline=None)
@given(reasoning, st.sampled_from([("VERDICT: ELEGANT", True), ("VERDICT: BASHY", False)]), st.text(" \n", max_size=3))
def test_one_final_verdict_line_parses(text, verdict, trailing):
    line, value = verdict
    assert parse_verdict(f"{text}\n{line}{trailing}") is value


@settings(max_examples=200, deadline=None)
@given(reasoning, st.permutations(["VERDICT: ELEGANT", "VERDICT: BASHY"]), st.text(min_size=1, max_size=20))
def test_none_both_or_trailing_text_do_not_parse(text, both, extra):
    assert parse_verdict(text) is None
    assert parse_verdict(f"{text}\n{both[0]}\n{both[1]}") is None
    if extra.strip():
        assert parse_verdict(f"{text}\n{both[0]}\n{extra}") is None


# -- templates ----------------------------------------------------------------------------------


def test_default_template_and_single_pass_render():
    template = load_template()
    assert "{problem}" in template and "{solution}" in template and "VERDICT: ELEGANT" in template
    text = render("P: {problem}\nS: {solution}\n\\boxed{x}", "find {solution}", "use {problem}")
    assert text == "P: find {solution}\nS: use {problem}\n\\boxed{x}"


@pytest.mark.parametrize("missing", ["problem", "solution"])
def test_template_missing_placeholder_is_config_error(tmp_path, missing, key):
    path = tmp_path / "judge.txt"
    path.write_text("Problem: {problem}\nSolution: {solution}\n".replace("{" + missing + "}", "(none)"))
    with pytest.raises(ConfigError, match=r"\{" + missing + r"\} placeholder"):
        HTTPJudge("http://127.0.0.1:1/v1", "m", api_key_env=KEY_ENV, prompt_file=str(path))
    with pytest.raises(ConfigError, match="not a file"):
        HTTPJudge("http://127.0.0.1:1/v1", "m", api_key_env=KEY_ENV, prompt_file=str(tmp_path / "absent.txt"))


def test_custom_template_is_what_the_server_receives(tmp_path, server):
    path = tmp_path / "mine.txt"
    path.write_text("HOUSE RULES 7.\n<solution>{solution}</solution>\nfor: {problem}\nVERDICT please.")
    judge = http_judge(server, prompt_file=str(path))
    assert judge.judge(PROBLEM, "by symmetry").elegant is True
    assert server.contents() == [f"HOUSE RULES 7.\n<solution>by symmetry</solution>\nfor: {PROBLEM}\nVERDICT please."]
    assert server.requests[0]["model"] == "standin" and server.requests[0]["temperature"] == 0.0


# -- rewards and labels -------------------------------------------------------------------------


def test_rewards_labels_and_who_the_judge_sees(server, caplog):
    judge = http_judge(server)
    verifier = EleganceVerifier(BoxedVerifier(), judge, bonus=0.5)
    completions, columns = rows(
        ("By symmetry, half of them: \\boxed{512}", "512"),
        ("Check each case: \\boxed{512}", "512"),
        ("By symmetry: \\boxed{500}", "512"),  # wrong: the judge is never asked
        ("garble garble \\boxed{512}", "512"),
    )
    with caplog.at_level(logging.WARNING, logger="tandem_lit.verifiers.judge"):
        grades = verifier.grade_batch(completions, **columns)
    assert [g.reward for g in grades] == [1.5, 1.0, 0.0, 1.0]
    assert [g.correct for g in grades] == [True, True, False, True]
    assert [g.labels for g in grades] == [
        {"inner": 1.0, "elegance_rate": 1.0, "judge_failure_rate": 0.0},
        {"inner": 1.0, "elegance_rate": 0.0, "judge_failure_rate": 0.0},
        {"inner": 1.0},
        {"inner": 1.0, "elegance_rate": 0.0, "judge_failure_rate": 1.0},
    ]
    means = label_means(grades)
    assert means["elegance_rate"] == (1 / 3, 3) and means["judge_failure_rate"] == (1 / 3, 3)
    asked = server.contents()
    assert len(asked) == 3 and not any("\\boxed{500}" in c for c in asked)
    assert all(PROBLEM in c for c in asked)
    assert judge.failures == {"unparseable": 1, "timeout": 0, "error": 0} and judge.requests == 3
    assert "unparseable" in caplog.text and "VERDICT: MAYBE" in caplog.text
    assert verifier(completions, **columns).tolist() == [1.5, 1.0, 0.0, 1.0]
    assert verifier.evaluate(completions, **columns) == [True, True, False, True]


def test_bonus_is_configurable_and_incorrect_batch_asks_nothing(server):
    verifier = EleganceVerifier(BoxedVerifier(), http_judge(server), bonus=1.0)
    completions, columns = rows(("By symmetry \\boxed{1}", "1"), ("By symmetry \\boxed{2}", "3"))
    assert [g.reward for g in verifier.grade_batch(completions, **columns)] == [2.0, 0.0]
    server.requests.clear()
    completions, columns = rows(("By symmetry \\boxed{2}", "3"))
    assert verifier.grade_batch(completions, **columns)[0].reward == 0.0
    assert server.requests == []
    with pytest.raises(ConfigError, match="bonus"):
        EleganceVerifier(BoxedVerifier(), http_judge(server), bonus=-0.5)


def test_columns_timeouts_and_problem_text(server):
    inner = BoxedVerifier()
    verifier = EleganceVerifier(inner, http_judge(server))
    assert verifier.required_columns == ("answer", "problem")
    with pytest.raises(MissingColumnError, match="problem"):
        verifier.grade_batch(["\\boxed{1}"], answer=["1"])
    with pytest.raises(DataError, match="problem"):
        verifier.grade_batch(["\\boxed{1}"], answer=["1"], problem=[""])
    inner.timeouts = 3
    assert verifier.timeouts == 3 and getattr(verifier, "timeouts", None) == 3

    class NoTimeouts(Verifier):
        def grade(self, completion, **columns):
            return Grade(correct=False, reward=0.0)

    assert getattr(EleganceVerifier(NoTimeouts(), http_judge(server)), "timeouts", None) is None


def test_long_solutions_are_sent_as_head_and_tail(server):
    verifier = EleganceVerifier(BoxedVerifier(), http_judge(server), max_solution_chars=1000)
    completion = "By symmetry " + "x" * 5000 + " so \\boxed{7}"
    verifier.grade_batch([completion], answer=["7"], problem=[PROBLEM])
    sent = server.contents()[0].split("<solution>\n")[1].split("\n</solution>")[0]
    head, tail = sent.split("\n[... ", 1)
    assert head == completion[:500]
    assert tail.endswith(completion[-500:]) and tail.startswith(f"{len(completion) - 1000} characters cut ...]")


def test_real_math_verifier_inside(server):
    from tandem_lit.verifiers.math import MathVerifier

    with EleganceVerifier(MathVerifier(workers=1, timeout_s=10.0), http_judge(server)) as verifier:
        assert verifier.required_columns == ("answer", "problem")
        completions, columns = rows(
            ("Pair each subset with its complement (symmetry): $\\boxed{\\frac{1}{2}}$", "0.5"),
            ("Go case by case: $\\boxed{1/2}$", "\\frac12"),
            ("By symmetry $\\boxed{3}$", "4"),
            ("No box, by symmetry", "4"),
        )
        grades = verifier.grade_batch(completions, **columns)
        assert [g.reward for g in grades] == [1.5, 1.0, 0.0, 0.0]
        assert [g.labels for g in grades] == [
            {"elegance_rate": 1.0, "judge_failure_rate": 0.0},
            {"elegance_rate": 0.0, "judge_failure_rate": 0.0},
            {},
            {},
        ]
        assert len(server.requests) == 2
        assert verifier.timeouts == 0


# -- failures: timeouts, retries, errors, auth --------------------------------------------------


def test_timeout_costs_the_bonus_not_the_reward(key):
    with StandinJudge(key, slow_s=1.5) as slow_server:
        judge = http_judge(slow_server, timeout_s=0.3, max_retries=1)
        verifier = EleganceVerifier(BoxedVerifier(), judge)
        started = time.monotonic()
        grade = verifier.grade("slow symmetry \\boxed{1}", answer="1", problem=PROBLEM)
        assert time.monotonic() - started < 1.5
        assert grade.reward == 1.0 and grade.correct
        assert grade.labels["judge_failure_rate"] == 1.0 and grade.labels["elegance_rate"] == 0.0
        assert judge.failures["timeout"] == 1 and len(slow_server.requests) == 2  # retried once
        assert judge.recent_failures[-1][0] == "timeout"


@pytest.mark.parametrize("word", ["flaky", "busy"])  # HTTP 500, HTTP 429 with Retry-After
def test_retryable_errors_are_retried(server, word):
    judge = http_judge(server, max_retries=2)
    verdict = judge.judge(PROBLEM, f"{word} symmetry")
    assert verdict.elegant is True and verdict.failure is None
    assert len(server.requests) == 2 and judge.failures == {"unparseable": 0, "timeout": 0, "error": 0}


def test_retries_run_out(server):
    judge = http_judge(server, max_retries=0)
    verdict = judge.judge(PROBLEM, "flaky symmetry")
    assert verdict.elegant is None and verdict.failure == "error" and "HTTP 500" in verdict.reply
    assert len(server.requests) == 1


@pytest.mark.parametrize("word, detail", [("toolong", "HTTP 400"), ("notjson", "not an OpenAI chat completion")])
def test_request_errors_fail_at_once(server, word, detail):
    judge = http_judge(server, max_retries=3)
    verdict = judge.judge(PROBLEM, f"{word} symmetry")
    assert verdict.failure == "error" and verdict.elegant is None and detail in verdict.reply
    assert len(server.requests) == 1  # a 400 or a broken body is not retried


def test_unreachable_server_costs_the_bonus(key):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    judge = HTTPJudge(f"http://127.0.0.1:{port}/v1", "m", api_key_env=KEY_ENV, max_retries=2, backoff_s=0.01)
    verifier = EleganceVerifier(BoxedVerifier(), judge)
    grade = verifier.grade("symmetry \\boxed{1}", answer="1", problem=PROBLEM)
    assert grade.reward == 1.0 and grade.labels["judge_failure_rate"] == 1.0
    assert judge.failures["error"] == 1 and "cannot reach" in judge.recent_failures[-1][1]


def test_a_judge_server_that_goes_away_mid_run_stops_the_run_in_one_line(key):
    """A few failures cost their bonus and training goes on; a server that answers nothing for
    ``give_up_after`` requests in a row is gone, and the run stops instead of training on
    without the bonus for good."""
    with StandinJudge(key) as standin:
        judge = http_judge(standin, max_retries=1, give_up_after=3)
        verifier = EleganceVerifier(BoxedVerifier(), judge)
        assert verifier.grade("symmetry \\boxed{1}", answer="1", problem=PROBLEM).labels["elegance_rate"] == 1.0
    for i in range(2):  # (each solution its own, so no cached verdict answers)
        grade = verifier.grade(f"case {i} \\boxed{{1}}", answer="1", problem=PROBLEM)
        assert grade.reward == 1.0 and grade.labels["judge_failure_rate"] == 1.0
    with pytest.raises(JudgeUnavailableError) as stopped:
        verifier.grade("case 2 \\boxed{1}", answer="1", problem=PROBLEM)
    assert isinstance(stopped.value, ConfigError) and "\n" not in str(stopped.value)
    assert str(stopped.value).startswith("the judge server has not answered 3 requests in a row (the last: cannot reach")
    # an answer in between starts the count again (a 500 with no retry left counts as not answered)
    with StandinJudge(key) as flaky:
        judge = http_judge(flaky, max_retries=0, give_up_after=2)
        assert judge.judge(PROBLEM, "flaky a").failure == "error"
        assert judge.judge(PROBLEM, "symmetry").elegant is True
        assert judge.judge(PROBLEM, "flaky b").failure == "error"
    with pytest.raises(JudgeUnavailableError, match="not answered 2 requests in a row"):
        judge.judge(PROBLEM, "case c")


def test_rejected_key_raises_naming_the_variable(server, monkeypatch, caplog):
    wrong = "sk-wrong-key-9876543210"
    monkeypatch.setenv(KEY_ENV, wrong)
    judge = http_judge(server, max_retries=3)
    with pytest.raises(JudgeAuthError, match=KEY_ENV) as info:
        judge.judge(PROBLEM, "symmetry")
    assert isinstance(info.value, ConfigError) and "401" in str(info.value)
    assert wrong not in str(info.value) and wrong not in caplog.text  # the server echoed it: redacted
    assert len(server.headers) == 1  # not retried


def test_wrong_path_is_a_config_error(server):
    judge = HTTPJudge(server.base_url.removesuffix("/v1"), "standin", api_key_env=KEY_ENV)
    with pytest.raises(ConfigError, match="base_url"):
        judge.judge(PROBLEM, "symmetry")


def test_missing_key_variable_and_no_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=KEY_ENV):
        HTTPJudge("http://127.0.0.1:1/v1", "m", api_key_env=KEY_ENV)
    with StandinJudge(None) as open_server:
        judge = HTTPJudge(open_server.base_url, "standin", api_key_env=None)
        assert judge.judge(PROBLEM, "by symmetry").elegant is True
        assert "Authorization" not in open_server.headers[0]


def test_key_never_leaks(server, caplog):
    judge = http_judge(server, timeout_s=0.3, max_retries=0)
    verifier = EleganceVerifier(BoxedVerifier(), judge)
    completions = ["symmetry \\boxed{1}", "garble \\boxed{1}", "notjson \\boxed{1}", "toolong \\boxed{1}"]
    with caplog.at_level(logging.DEBUG):
        verifier.grade_batch(completions, answer=["1"] * 4, problem=[PROBLEM] * 4)
    assert server.headers[0]["Authorization"] == f"Bearer {SECRET}"  # it was sent...
    texts = [caplog.text, repr(verifier), repr(judge), str(judge.recent_failures), str(vars(judge))]
    assert not any(SECRET in text for text in texts)  # ...and is nowhere else
    assert SECRET.encode() not in pickle.dumps(verifier)
    assert KEY_ENV in repr(judge)


# -- concurrency, cache, pickling ---------------------------------------------------------------


def test_concurrency_limit(key):
    with StandinJudge(key, hold_s=0.15) as busy_server:
        judge = http_judge(busy_server, max_concurrency=3)
        solutions = [f"symmetry number {i}" for i in range(10)]
        threads = [
            threading.Thread(target=judge.judge_batch, args=([(PROBLEM, s) for s in half],))
            for half in (solutions[:5], solutions[5:])
        ]
        for thread in threads:  # two batches at once still share the limit
            thread.start()
        for thread in threads:
            thread.join()
        assert len(busy_server.requests) == 10
        assert 2 <= busy_server.max_in_flight <= 3


def test_cache_memory_file_and_identity(server, tmp_path):
    cache_file = tmp_path / "verdicts.jsonl"
    judge = http_judge(server, cache_file=str(cache_file))
    first = judge.judge_batch([(PROBLEM, "symmetry A"), (PROBLEM, "symmetry A"), (PROBLEM, "case B")])
    assert [v.elegant for v in first] == [True, True, False] and len(server.requests) == 2  # the pair once
    again = judge.judge_batch([(PROBLEM, "case B"), (PROBLEM, "symmetry A")])
    assert [(v.elegant, v.cached) for v in again] == [(False, True), (True, True)] and len(server.requests) == 2
    assert len(cache_file.read_text().splitlines()) == 2

    fresh = http_judge(server, cache_file=str(cache_file))  # a new run with the same judge
    assert [v.elegant for v in fresh.judge_batch([(PROBLEM, "symmetry A"), (PROBLEM, "case B")])] == [True, False]
    assert len(server.requests) == 2
    assert fresh.judge("another problem", "symmetry A").cached is False and len(server.requests) == 3

    template = tmp_path / "other.txt"
    template.write_text("Judge this.\n<solution>{solution}</solution>\n{problem}")
    for other in (
        http_judge(server, cache_file=str(cache_file), prompt_file=str(template)),
        http_judge(server, cache_file=str(cache_file), model="other"),
    ):
        before = len(server.requests)
        assert other.judge(PROBLEM, "symmetry A").cached is False and len(server.requests) == before + 1

    judge.judge(PROBLEM, "garble C")
    judge.judge(PROBLEM, "garble C")  # failures are asked again, never cached
    assert judge.failures["unparseable"] == 2
    cache_file.write_text(cache_file.read_text() + '{"key": "cut sh')  # a run killed mid-write
    assert http_judge(server, cache_file=str(cache_file)).judge(PROBLEM, "case B").cached is True


def test_cache_is_bounded(server):
    judge = http_judge(server, cache_size=2)
    judge.judge_batch([(PROBLEM, f"symmetry {i}") for i in range(3)])
    assert judge.judge(PROBLEM, "symmetry 2").cached and not judge.judge(PROBLEM, "symmetry 0").cached


def test_failure_warnings_are_rate_limited(server, caplog, monkeypatch):
    judge = http_judge(server)
    with caplog.at_level(logging.WARNING, logger="tandem_lit.verifiers.judge"):
        judge.judge_batch([(PROBLEM, f"garble {i}") for i in range(4)])
        assert len(caplog.records) == 1 and judge.failures["unparseable"] == 4
        monkeypatch.setattr(Judge, "WARN_INTERVAL_S", 0.0)
        judge.judge(PROBLEM, "garble 5")
    assert len(caplog.records) == 2 and "3 more failures since the last warning" in caplog.records[1].getMessage()


def test_pickles_without_runtime_and_works_after(server):
    judge = http_judge(server, cache_size=10)
    verifier = EleganceVerifier(BoxedVerifier(), judge)
    verifier.grade("symmetry \\boxed{1}", answer="1", problem=PROBLEM)
    assert judge._pool is not None
    copy = pickle.loads(pickle.dumps(verifier))
    assert copy.judge._pool is None and len(copy.judge._cache) == 0 and copy.judge.requests == 0
    assert copy.judge.identity == judge.identity and copy.judge.template == judge.template
    assert copy.grade("case work \\boxed{1}", answer="1", problem=PROBLEM).reward == 1.0
    assert copy.grade("symmetry \\boxed{1}", answer="1", problem=PROBLEM).reward == 1.5
    verifier.close()


# -- a local transformers judge -----------------------------------------------------------------

SHORT_TEMPLATE = "Problem: {problem}\nSolution: {solution}\nIs it elegant or bashy?\n"


@pytest.fixture(scope="module")
def tiny_judge_dir(tmp_path_factory):
    from conftest import tiny_llama

    from tandem_lit.models.tiny import char_tokenizer, write_model_dir

    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), seed=3, init_range=0.2)
    path = tmp_path_factory.mktemp("judge_model")
    write_model_dir(path, model.config, tokenizer, model)
    (path / "template.txt").write_text(SHORT_TEMPLATE)
    return path


def test_transformers_judge_generates_and_fails_safely(tiny_judge_dir, caplog):
    judge = TransformersJudge(
        str(tiny_judge_dir), prompt_file=str(tiny_judge_dir / "template.txt"), max_new_tokens=24, device="cpu"
    )
    verifier = EleganceVerifier(BoxedVerifier(), judge)
    with caplog.at_level(logging.WARNING, logger="tandem_lit.verifiers.judge"):
        grades = verifier.grade_batch(
            ["by symmetry \\boxed{1}", "cases \\boxed{1}", "wrong \\boxed{2}"], answer=["1"] * 3, problem=["1+0?"] * 3
        )
    assert [g.reward for g in grades] == [1.0, 1.0, 0.0]  # a random model writes no verdict line
    assert [g.labels.get("judge_failure_rate") for g in grades] == [1.0, 1.0, None]
    assert judge.failures["unparseable"] == 2 and judge.requests == 2 and "unparseable" in caplog.text
    reply = judge.recent_failures[0][1]
    assert reply and "VERDICT" not in reply
    state = pickle.dumps(judge)
    assert len(state) < 10_000 and pickle.loads(state)._model is None


def hand_scores(path, prompt: str) -> list[float]:
    """Sum of log p(token) of each verdict line after the prompt, one token at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(prompt)["input_ids"]
    scores = []
    for line in ("VERDICT: ELEGANT", "VERDICT: BASHY"):
        continuation = tokenizer(line, add_special_tokens=False)["input_ids"]
        total = 0.0
        for t, token in enumerate(continuation):
            with torch.no_grad():
                logits = model(torch.tensor([ids + continuation[:t]])).logits[0, -1]
            total += float(torch.log_softmax(logits.double(), -1)[token])
        scores.append(total)
    return scores


def test_transformers_judge_score_mode_is_the_likelier_line(tiny_judge_dir):
    template = str(tiny_judge_dir / "template.txt")
    judge = TransformersJudge(str(tiny_judge_dir), prompt_file=template, mode="score", dtype="float32", device="cpu")
    pairs = [("1+0?", "by symmetry, 1"), ("Count the subsets.", "case 1: a; case 2: b"), ("x?", "x")]
    verdicts = judge.judge_batch(pairs)
    for (problem, solution), verdict in zip(pairs, verdicts):
        elegant, bashy = hand_scores(tiny_judge_dir, render(SHORT_TEMPLATE, problem, solution))
        assert verdict.failure is None and verdict.elegant is (elegant > bashy)
        assert (
            f"log p(ELEGANT line) = {elegant:.4f}" in verdict.reply
            and f"log p(BASHY line) = {bashy:.4f}" in verdict.reply
        )
    assert judge.failures == {"unparseable": 0, "timeout": 0, "error": 0}
