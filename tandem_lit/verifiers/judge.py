"""Judges: a language model asked whether a correct solution is elegant or bashy.

A judge turns (problem, solution) pairs into ``Verdict``s. Two kinds, chosen by ``class_path``:

- ``HTTPJudge``: any OpenAI-compatible chat-completions server (``vllm serve``, a hosted API).
- ``TransformersJudge``: a local causal LM through ``transformers``, greedy generation or
  ``mode: score`` (the more likely of the two verdict lines, always parseable).

What they share lives in ``Judge``: the prompt template (a file the user can replace, with
``{problem}`` and ``{solution}`` placeholders), the strict verdict parser, the cache and the
failure accounting. A judge that fails (no reply in time, an unreadable reply, a server error)
gives a verdict with ``elegant=None`` and a ``failure`` kind: the caller withholds the bonus and
training goes on. Only what would fail every later call the same way raises (a rejected API
key, a wrong URL or model name, a missing key variable): a run whose bonus silently never
applies is a wrong experiment, not a degraded one.

The verdict rule (``parse_verdict``): after removing ``<think>...</think>`` blocks, the reply's
last non-blank line is exactly ``VERDICT: ELEGANT`` or ``VERDICT: BASHY`` (surrounding spaces
allowed), and no other line starts with the word "verdict" (in any case, after any markup).
Anything else (no verdict, two verdicts, text after the verdict, ``**VERDICT: ELEGANT**``,
``VERDICT: elegant``) is unparseable: the reply is a failure, never a guess.

Importing this module needs neither torch nor transformers; ``TransformersJudge`` imports them
when it first loads its model.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import math
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from tandem_lit.errors import ConfigError, JudgeAuthError, JudgeUnavailableError

__all__ = [
    "HTTPJudge",
    "Judge",
    "JudgeAuthError",
    "JudgeUnavailableError",
    "Reply",
    "TransformersJudge",
    "Verdict",
    "load_template",
    "parse_verdict",
    "render",
]

log = logging.getLogger(__name__)

PLACEHOLDERS = ("problem", "solution")
ELEGANT_LINE, BASHY_LINE = "VERDICT: ELEGANT", "VERDICT: BASHY"
FAILURES = ("unparseable", "timeout", "error")
DEFAULT_TEMPLATE = "prompts/elegance_judge.txt"  # package data of tandem_lit.verifiers

_PLACEHOLDER = re.compile(r"\{(problem|solution)\}")
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_VERDICT_LIKE = re.compile(r"^[\W_]*verdict\b", re.IGNORECASE)


@dataclass(frozen=True)
class Verdict:
    """The judge's answer on one solution."""

    elegant: bool | None  # None: no verdict (see ``failure``); the caller withholds the bonus
    failure: str | None = None  # "unparseable", "timeout" or "error"
    reply: str = ""  # the judge's text, or what went wrong; "" for a cached verdict
    cached: bool = False


@dataclass(frozen=True)
class Reply:
    """What a judge backend returns for one prompt: its text, or a failure and what went wrong."""

    text: str
    failure: str | None = None  # "timeout" or "error"; unparseable text is decided by the parser
    unreachable: bool = False  # no attempt reached the server and got its answer (connection, timeout, 5xx, 429)


# -- template and parser ------------------------------------------------------------------------


def load_template(prompt_file: str | None = None) -> str:
    """The prompt template: ``prompt_file``, or the packaged default. It must contain every
    placeholder in ``PLACEHOLDERS``; other braces (LaTeX) are left alone."""
    if prompt_file is None:
        text = resources.files("tandem_lit.verifiers").joinpath(DEFAULT_TEMPLATE).read_text(encoding="utf-8")
        where = f"the packaged template {DEFAULT_TEMPLATE}"
    else:
        path = Path(prompt_file).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"prompt_file {prompt_file!r} is not a file; give a text file with {{problem}} and {{solution}}"
            )
        text = path.read_text(encoding="utf-8")
        where = f"prompt_file {prompt_file!r}"
    missing = [name for name in PLACEHOLDERS if "{" + name + "}" not in text]
    if missing:
        raise ConfigError(
            f"{where} has no {{{missing[0]}}} placeholder; a judge template needs "
            f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)} (missing: {', '.join(missing)})"
        )
    return text


def render(template: str, problem: str, solution: str) -> str:
    """Fill the placeholders in one pass, so text inside the problem or solution that looks like a
    placeholder stays as written."""
    values = {"problem": problem, "solution": solution}
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def parse_verdict(reply: str) -> bool | None:
    """True for ELEGANT, False for BASHY, None when the reply breaks the rule in the module docstring."""
    text = _THINK_BLOCK.sub("", reply)
    if "<think>" in text:  # reasoning cut off before it closed: no answer was given
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    verdict_lines = [i for i, line in enumerate(lines) if _VERDICT_LIKE.match(line)]
    if verdict_lines != [len(lines) - 1]:
        return None
    return {ELEGANT_LINE: True, BASHY_LINE: False}.get(lines[-1])


def truncate(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more characters]"


# -- the base class -----------------------------------------------------------------------------


class Judge(ABC):
    """Base class: template, strict parsing, cache, failure counts. Subclasses implement
    ``identity`` and ``replies`` (prompts in, one ``Reply`` each out).

    Args:
        prompt_file: Template file with ``{problem}`` and ``{solution}``; None for the packaged one.
        cache_size: Verdicts kept in memory (LRU), keyed by (judge identity with the template's
            hash, problem, solution). Only parsed verdicts are cached; failures are asked again.
        cache_file: JSON Lines file that keeps verdicts across runs: read at first use, appended
            to after every batch. None: memory only.
    """

    WARN_INTERVAL_S = 60.0  # at most one failure warning per interval; the rest are counted

    _runtime = (
        "_lock",
        "_cache",
        "_cache_loaded",
        "failures",
        "requests",
        "recent_failures",
        "_last_warning",
        "_quiet",
    )

    def __init__(self, prompt_file: str | None = None, cache_size: int = 100_000, cache_file: str | None = None):
        if cache_size < 0:
            raise ConfigError(f"cache_size must be >= 0, got {cache_size}")
        self.prompt_file = prompt_file
        self.template = load_template(prompt_file)
        self.template_hash = hashlib.sha256(self.template.encode()).hexdigest()[:16]
        self.cache_size = cache_size
        self.cache_file = cache_file
        self._setup_runtime()

    def _setup_runtime(self) -> None:
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, bool] = OrderedDict()
        self._cache_loaded = False
        self.failures = dict.fromkeys(FAILURES, 0)  # verdicts withheld, by kind, over this object's life
        self.requests = 0  # prompts sent to the model (cache misses)
        self.recent_failures: deque[tuple[str, str]] = deque(maxlen=20)  # (kind, truncated reply or error)
        self._last_warning = -math.inf
        self._quiet = 0  # failures since the last warning

    # Lightning pickles/deep-copies modules: settings travel, never threads, locks, models or secrets.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._runtime}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup_runtime()

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # noqa: B027 - a judge that holds nothing has nothing to release
        """Release threads or models (a later call starts them again)."""

    @property
    @abstractmethod
    def identity(self) -> str:
        """What decides the verdicts besides the template (kind, model, sampling settings); part of
        the cache key. Never a secret."""

    @abstractmethod
    def replies(self, prompts: Sequence[str]) -> list[Reply]:
        """One reply per rendered prompt. Raise only for errors every later call would repeat."""

    def cache_key(self, problem: str, solution: str) -> str:
        fields = [self.identity, self.template_hash, problem, solution]
        return hashlib.sha256(json.dumps(fields, ensure_ascii=False).encode()).hexdigest()

    def judge(self, problem: str, solution: str) -> Verdict:
        return self.judge_batch([(problem, solution)])[0]

    def judge_batch(self, items: Sequence[tuple[str, str]]) -> list[Verdict]:
        """Verdicts for (problem, solution) pairs: cached ones at once, the rest asked together
        (each distinct pair once)."""
        keys = [self.cache_key(problem, solution) for problem, solution in items]
        verdicts: dict[str, Verdict] = {}
        with self._lock:
            self._load_cache_file()
            for key in keys:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    verdicts[key] = Verdict(self._cache[key], cached=True)
        todo = {key: item for key, item in zip(keys, items) if key not in verdicts}  # each pair once
        if todo:
            replies = self.replies([render(self.template, problem, solution) for problem, solution in todo.values()])
            fresh: list[tuple[str, bool]] = []
            with self._lock:
                self.requests += len(todo)
                for key, reply in zip(todo, replies):
                    elegant = None if reply.failure else parse_verdict(reply.text)
                    failure = reply.failure or ("unparseable" if elegant is None else None)
                    verdicts[key] = Verdict(elegant, failure, reply.text)
                    if failure:
                        self._note_failure(failure, reply.text)
                    else:
                        self._cache[key] = elegant
                        fresh.append((key, elegant))
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
                self._append_cache_file(fresh)
        return [verdicts[key] for key in keys]

    def _note_failure(self, kind: str, detail: str) -> None:
        """Count it; warn with the truncated reply, at most once per WARN_INTERVAL_S (under the lock)."""
        self.failures[kind] += 1
        self.recent_failures.append((kind, truncate(detail)))
        now = time.monotonic()
        if now - self._last_warning < self.WARN_INTERVAL_S:
            self._quiet += 1
            return
        quiet = f" ({self._quiet} more failures since the last warning)" if self._quiet else ""
        log.warning(
            "%s gave no verdict (%s), so the solution counts as not elegant%s; totals %s. Reply: %r",
            type(self).__name__,
            kind,
            quiet,
            self.failures,
            truncate(detail),
        )
        self._last_warning, self._quiet = now, 0

    def _load_cache_file(self) -> None:
        if self._cache_loaded or self.cache_file is None:
            return
        self._cache_loaded = True
        path = Path(self.cache_file).expanduser()
        if not path.exists():
            return
        unreadable = 0
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                try:
                    entry = json.loads(line)
                    key, elegant = entry["key"], entry["elegant"]
                except (ValueError, KeyError, TypeError):
                    unreadable += 1  # e.g. a line cut short when a run was killed mid-write
                    continue
                if isinstance(key, str) and isinstance(elegant, bool):
                    self._cache[key] = elegant
                    self._cache.move_to_end(key)
                else:
                    unreadable += 1
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        if unreadable:
            log.warning("judge cache %s: skipped %d unreadable lines", path, unreadable)

    def _append_cache_file(self, entries: list[tuple[str, bool]]) -> None:
        if self.cache_file is None or not entries:
            return
        path = Path(self.cache_file).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(
            json.dumps({"key": key, "elegant": elegant, "judge": self.identity}) + "\n" for key, elegant in entries
        )
        with path.open(
            "a", encoding="utf-8"
        ) as file:  # one write per batch: processes sharing a file interleave whole batches
            file.write(lines)


# -- an OpenAI-compatible server ----------------------------------------------------------------


class HTTPJudge(Judge):
    """A chat model behind an OpenAI-compatible ``/chat/completions`` endpoint (vLLM's
    ``vllm serve``, SGLang, a hosted API), through the standard library's ``urllib``.

    The API key is read from the environment variable ``api_key_env`` at every request and
    never stored: it is not an attribute, not pickled, not in ``repr``, logs or errors (text a
    server echoes back is redacted).

    Retries: connection errors, timeouts, HTTP 408, 429 and 5xx are retried ``max_retries``
    times, waiting ``backoff_s`` x 2^attempt (with jitter; a numeric ``Retry-After`` up to 60 s
    wins); then the verdict is a failure (``timeout`` or ``error``). Other 4xx answers concern one
    request (e.g. a prompt over the context length): a failure at once. 401/403 raise
    ``JudgeAuthError`` naming the variable and 404 a ``ConfigError``: every later call would fail
    the same way.

    Args:
        base_url: Server root including the API version, e.g. ``http://localhost:8000/v1``.
        model: Model name the server knows (vLLM: the served model name).
        api_key_env: Environment variable holding the key, sent as ``Authorization: Bearer``;
            None for a server without authentication.
        prompt_file: Template file (``{problem}``, ``{solution}``); None for the packaged one.
        max_concurrency: Requests in flight at once, over all batches of this object.
        max_retries: Extra attempts after a retryable failure.
        timeout_s: Socket timeout of each attempt (connecting, and each wait for data).
        backoff_s: First retry delay; it doubles with every attempt.
        temperature: Sampling temperature (0: greedy, which makes verdicts cacheable in spirit too).
        max_tokens: Reply length limit; a reply cut off before its verdict line is unparseable.
        cache_size: Verdicts kept in memory (LRU).
        cache_file: JSON Lines file keeping verdicts across runs; None: memory only.
        give_up_after: Requests in a row the server does not answer (after their retries) before
            the run stops with ``JudgeUnavailableError``: a server that went away mid-run would
            otherwise withhold every later bonus with no more than a warning a minute.
    """

    _runtime = (*Judge._runtime, "_pool", "_unreachable")

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str | None = "OPENAI_API_KEY",
        prompt_file: str | None = None,
        max_concurrency: int = 8,
        max_retries: int = 3,
        timeout_s: float = 60.0,
        backoff_s: float = 1.0,
        temperature: float = 0.0,
        max_tokens: int = 512,
        cache_size: int = 100_000,
        cache_file: str | None = None,
        give_up_after: int = 32,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must start with http:// or https://, got {base_url!r}")
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0, got {max_retries}")
        if timeout_s <= 0 or backoff_s < 0:
            raise ConfigError(f"timeout_s must be > 0 and backoff_s >= 0, got {timeout_s} and {backoff_s}")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        if give_up_after < 1:
            raise ConfigError(f"give_up_after must be >= 1, got {give_up_after}")
        self.give_up_after = give_up_after
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.temperature = temperature
        self.max_tokens = max_tokens
        super().__init__(prompt_file, cache_size, cache_file)
        self._api_key()  # a missing variable is an error now, not at the first correct solution

    def _setup_runtime(self) -> None:
        super()._setup_runtime()
        self._pool: ThreadPoolExecutor | None = None
        self._unreachable = 0  # requests in a row that did not reach the server

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    @property
    def identity(self) -> str:
        return f"http {self.base_url} model={self.model} temperature={self.temperature} max_tokens={self.max_tokens}"

    def _api_key(self) -> str | None:
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(
                f"HTTPJudge reads its API key from the environment variable {self.api_key_env}, which is not set "
                f"(or empty). Export it, name another variable in api_key_env, or set api_key_env: null for a "
                f"server without authentication."
            )
        return key

    def _redact(self, text: str) -> str:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return text.replace(key, f"${self.api_key_env}") if key else text

    def replies(self, prompts: Sequence[str]) -> list[Reply]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="judge")
            pool = self._pool
        futures = [pool.submit(self._ask, prompt) for prompt in prompts]
        replies = [future.result() for future in futures]  # re-raises JudgeAuthError / ConfigError
        with self._lock:
            for reply in replies:
                self._unreachable = self._unreachable + 1 if reply.unreachable else 0
            if self._unreachable >= self.give_up_after:
                last = next(reply.text for reply in reversed(replies) if reply.unreachable)
                raise JudgeUnavailableError(
                    f"the judge server has not answered {self._unreachable} requests in a row (the last: "
                    f"{last}); the run stops rather than go on without the elegance bonus: start the server again "
                    f"(or raise give_up_after), then resume from the run's checkpoints/last.ckpt with --ckpt_path"
                )
        return replies

    def _ask(self, prompt: str) -> Reply:
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
            }
        ).encode()
        failure, delay = Reply("not asked", "error"), 0.0
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(delay)
            delay = self.backoff_s * 2**attempt * random.uniform(0.5, 1.0)
            try:
                payload = self._post(body)
            except urllib.error.HTTPError as err:
                detail = self._redact(f"HTTP {err.code} from {self.url}: {_error_text(err)}")
                if err.code in (401, 403):
                    raise JudgeAuthError(
                        f"the judge server rejected the API key in the environment variable {self.api_key_env} "
                        f"({detail}). Check the key (every later request would fail the same way)."
                    ) from None
                if err.code == 404:
                    raise ConfigError(
                        f"{detail}. Check base_url (it should end in the API version, e.g. /v1) and model "
                        f"{self.model!r} (the name the server serves)."
                    ) from None
                if err.code not in (408, 429) and err.code < 500:
                    return Reply(detail, "error")  # about this request; asking again gives the same
                failure = Reply(detail, "error", True)  # (a server behind a proxy that is gone: 502, 503)
                retry_after = (err.headers or {}).get("Retry-After", "")
                if retry_after.strip().isdigit():
                    delay = min(float(retry_after), 60.0)
                continue
            except TimeoutError:
                failure = Reply(f"no reply from {self.url} within timeout_s={self.timeout_s}", "timeout", True)
                continue
            except urllib.error.URLError as err:
                kind = "timeout" if isinstance(err.reason, TimeoutError) else "error"
                failure = Reply(self._redact(f"cannot reach {self.url}: {err.reason}"), kind, True)
                continue
            except (http.client.HTTPException, OSError) as err:
                failure = Reply(self._redact(f"connection to {self.url} failed: {type(err).__name__}: {err}"), "error", True)
                continue
            return self._content(payload)
        return failure

    def _post(self, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json"}
        key = self._api_key()
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return response.read()

    def _content(self, payload: bytes) -> Reply:
        try:
            content = json.loads(payload)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return Reply(self._redact(f"not an OpenAI chat completion: {payload[:300]!r}"), "error")
        return Reply(content if isinstance(content, str) else "")

    def __repr__(self) -> str:
        return (
            f"HTTPJudge(base_url={self.base_url!r}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
            f"prompt_file={self.prompt_file!r}, template_hash={self.template_hash!r}, "
            f"max_concurrency={self.max_concurrency}, timeout_s={self.timeout_s}, max_retries={self.max_retries})"
        )


def _error_text(err: urllib.error.HTTPError) -> str:
    """The server's error message, short (OpenAI-style ``{"error": {"message": ...}}`` or raw)."""
    try:
        raw = err.read(2000).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return str(err.reason or "")
    finally:
        err.close()
    try:
        message = json.loads(raw)["error"]
        raw = message.get("message", raw) if isinstance(message, dict) else str(message)
    except (ValueError, KeyError, TypeError):
        pass
    return truncate(raw.strip() or str(err.reason), 300)


# -- a local transformers model -----------------------------------------------------------------


class TransformersJudge(Judge):
    """A local causal LM (hub name or folder, the same loaders as the senior and junior).

    ``mode: generate`` writes a greedy reply to the rendered prompt and parses it like any
    judge's. ``mode: score`` writes nothing: it compares the log-likelihood (summed over tokens)
    of the two verdict lines as the start of the reply and picks the likelier, BASHY on a tie.
    A score is always parseable, costs one forward pass, and skips the reasoning the template
    asks for; it suits small judges whose free text rarely follows the format.

    The model loads on first use, on ``device`` (``auto``: this process's GPU, else the CPU),
    and is not pickled. Errors of a local model (out of memory, a bug) are raised, not counted.

    Args:
        path: Hub name or local folder (``pkg://`` and ``demo://`` as for the senior).
        prompt_file: Template file (``{problem}``, ``{solution}``); None for the packaged one.
        mode: ``generate`` or ``score``.
        max_new_tokens: Reply length limit in generate mode.
        dtype: ``auto`` (bfloat16 on a GPU that has it, else float32), ``float32``, ``bfloat16``, ``float16``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:1``...
        chat_template: Wrap the prompt in the tokenizer's chat template as a user turn. None: when
            the tokenizer has one; True without one is an error.
        batch_size: Prompts generated together (left-padded).
        gguf_file: GGUF file inside ``path`` (needs the ``gguf`` package).
        cache_size: Verdicts kept in memory (LRU).
        cache_file: JSON Lines file keeping verdicts across runs; None: memory only.
    """

    _runtime = (*Judge._runtime, "_model", "_tokenizer", "_model_lock")

    def __init__(
        self,
        path: str,
        prompt_file: str | None = None,
        mode: Literal["generate", "score"] = "generate",
        max_new_tokens: int = 512,
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
        device: str = "auto",
        chat_template: bool | None = None,
        batch_size: int = 8,
        gguf_file: str | None = None,
        cache_size: int = 100_000,
        cache_file: str | None = None,
    ):
        if mode not in ("generate", "score"):
            raise ConfigError(f"mode must be 'generate' or 'score', got {mode!r}")
        if max_new_tokens < 1 or batch_size < 1:
            raise ConfigError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens} and {batch_size}")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
        self.path = path
        self.mode = mode
        self.max_new_tokens = max_new_tokens
        self.dtype = dtype
        self.device = device
        self.chat_template = chat_template
        self.batch_size = batch_size
        self.gguf_file = gguf_file
        super().__init__(prompt_file, cache_size, cache_file)

    def _setup_runtime(self) -> None:
        super()._setup_runtime()
        self._model = None
        self._tokenizer = None
        self._model_lock = threading.Lock()  # one forward pass at a time

    def close(self) -> None:
        with self._model_lock:
            self._model = self._tokenizer = None

    @property
    def identity(self) -> str:
        settings = f"mode={self.mode} chat_template={self.chat_template} dtype={self.dtype}"
        length = f" max_new_tokens={self.max_new_tokens}" if self.mode == "generate" else ""
        return f"transformers {self.path} gguf={self.gguf_file} {settings}{length}"

    def _load(self) -> None:
        import torch

        from tandem_lit.models import ModelSource, freeze, load_causal_lm, load_tokenizer

        source = ModelSource(self.path, gguf_file=self.gguf_file, dtype=self.dtype)
        tokenizer = load_tokenizer(source)
        if self.chat_template and tokenizer.chat_template is None:
            raise ConfigError(f"chat_template: true, but the tokenizer of {self.path!r} has no chat template")
        device = self.device
        if device == "auto":
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        model = freeze(load_causal_lm(source)).to(device)
        log.info("judge %s loaded on %s (%s)", self.path, device, self.mode)
        self._model, self._tokenizer = model, tokenizer

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids of the prompt, up to where the judge's reply starts."""
        tokenizer = self._tokenizer
        use_chat = self.chat_template if self.chat_template is not None else tokenizer.chat_template is not None
        if use_chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer(prompt)["input_ids"]

    def replies(self, prompts: Sequence[str]) -> list[Reply]:
        with self._model_lock:
            if self._model is None:
                self._load()
            ids = [self.prompt_ids(prompt) for prompt in prompts]
            if self.mode == "score":
                return [self._score(prompt) for prompt in ids]
            out: list[Reply] = []
            for start in range(0, len(ids), self.batch_size):
                out.extend(self._generate(ids[start : start + self.batch_size]))
            return out

    def _generate(self, batch: list[list[int]]) -> list[Reply]:
        import torch

        tokenizer, model = self._tokenizer, self._model
        width = max(len(ids) for ids in batch)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=model.device)  # [B, T]
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=model.device)  # [B, T]
        with torch.no_grad():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )  # [B, T + new]
        texts = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
        return [Reply(text) for text in texts]

    def _score(self, prompt: list[int]) -> Reply:
        import torch

        tokenizer, model = self._tokenizer, self._model
        lines = (ELEGANT_LINE, BASHY_LINE)
        continuations = [tokenizer(line, add_special_tokens=False)["input_ids"] for line in lines]
        width = len(prompt) + max(len(c) for c in continuations)
        pad = tokenizer.pad_token_id
        rows = [prompt + c + [pad] * (width - len(prompt) - len(c)) for c in continuations]
        masks = [[1] * (len(prompt) + len(c)) + [0] * (width - len(prompt) - len(c)) for c in continuations]
        input_ids = torch.tensor(rows, device=model.device)  # [2, T]
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=torch.tensor(masks, device=model.device)).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]  # [2, T-1]
        # token t of the continuation is predicted at position len(prompt) - 1 + t
        scores = [float(logp[i, len(prompt) - 1 : len(prompt) - 1 + len(c)].sum()) for i, c in enumerate(continuations)]
        verdict = ELEGANT_LINE if scores[0] > scores[1] else BASHY_LINE
        return Reply(f"log p(ELEGANT line) = {scores[0]:.4f}, log p(BASHY line) = {scores[1]:.4f}\n{verdict}")

    def __repr__(self) -> str:
        return (
            f"TransformersJudge(path={self.path!r}, mode={self.mode!r}, prompt_file={self.prompt_file!r}, "
            f"template_hash={self.template_hash!r}, device={self.device!r}, dtype={self.dtype!r})"
        )
