"""A reward computed by an HTTP service that speaks the hybridrl reward contract.

``POST {url}/score`` with ``{"prompts", "responses", "answers", "metadata", "messages",
"response_lengths"}`` (lists, one entry per response) answers ``{"scores": [...],
"rewards": {name: [...]}}``; ``GET {url}/health`` answers ``{"status": "ok", ...}``.
``hybridrl serve-reward CONFIG`` is such a service; docs/rewards.md describes the contract.
Redirects are not followed (the token would go along); an answer over max_answer_mb (16 MiB) is
not read, and one whose scores are not the right count of finite numbers is an error naming the
field and the value.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

from hybridrl_http.client import ServiceError, get_json, post_json
from pydantic import Field

from hybridrl.components import Options, RewardFunction
from hybridrl.options import Secret


def jsonable(value):
    """``value`` as plain JSON types (anything else becomes its string)."""
    return json.loads(json.dumps(value, default=str))


class RemoteReward(RewardFunction):
    """Scores from a reward service over HTTP, in batches, with timeouts and retries."""

    function = "remote"

    class Options(Options):
        url: str = Field(
            pattern=r"^https?://",
            description="Base URL of the service, e.g. http://127.0.0.1:8700; requests go to {url}/score.",
        )
        token: Secret | None = Field(
            None,
            description="Bearer token the service requires. The run's config.yaml shows it as '<redacted>': give it "
            "as '${env:VAR}' or with token_env to keep it out of the YAML too.",
        )
        token_env: str | None = Field(
            None, description="Name of an environment variable holding the token (keeps it out of the YAML)."
        )
        reward: str | None = Field(
            None, description="Use this named reward of the answer's 'rewards' instead of the combined 'scores'."
        )
        batch_size: int = Field(64, gt=0, description="Responses per request.")
        concurrency: int = Field(1, gt=0, description="Requests in flight at once.")
        timeout: float = Field(60.0, gt=0, description="Seconds to wait for one answer.")
        retries: int = Field(3, ge=0, description="Retries after a connection error, a timeout or a 5xx/429 answer.")
        backoff: float = Field(0.5, ge=0, description="First retry delay in seconds; doubles each retry.")
        check_health: bool = Field(True, description="GET {url}/health when the run starts, to fail early.")
        max_answer_mb: float = Field(
            16,
            gt=0,
            description="The most MiB read of one answer; a larger one is an error (a batch's scores take a few "
            "KiB: more is a wrong URL or a faulty service, and reading it would fill the memory).",
        )

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.component = f"reward function 'remote' ({options.url})"
        self.base = options.url.rstrip("/")
        self.token = options.token.get_secret_value() if options.token else None
        if options.token_env:
            self.token = os.environ.get(options.token_env)
            if not self.token:
                raise ValueError(f"{self.component}: token_env is '{options.token_env}', but it is not set.")
        if options.check_health:
            self._check_health()

    def _request(self, path: str, payload=None):
        o = self.options
        call = post_json if payload is not None else get_json
        args = (payload,) if payload is not None else ()
        return call(
            f"{self.base}{path}",
            *args,
            component=self.component,
            timeout=o.timeout,
            retries=o.retries,
            backoff=o.backoff,
            token=self.token,
            max_bytes=int(o.max_answer_mb * 2**20),
            limit_key="max_answer_mb",
        )

    def _check_health(self) -> None:
        try:
            health = self._request("/health")
        except ServiceError as e:
            raise ServiceError(f"{e} Start the service first, e.g. hybridrl serve-reward CONFIG.") from None
        names = [r.get("name") for r in (health or {}).get("rewards", []) if isinstance(r, dict)]
        if self.options.reward and names and self.options.reward not in names:
            raise ValueError(
                f"{self.component}: reward is '{self.options.reward}', but the service serves {', '.join(names)}."
            )

    def score(self, batch):
        n, size = len(batch["response_text"]), self.options.batch_size
        lengths = batch["response_mask"].sum(-1).tolist() if "response_mask" in batch else None
        chunks = []
        for start in range(0, n, size):
            rows = slice(start, min(start + size, n))
            payload = {
                "prompts": list(batch["prompt_text"][rows]),
                "responses": list(batch["response_text"][rows]),
                "answers": jsonable(list(batch["answer"][rows])) if "answer" in batch else None,
                "metadata": jsonable(list(batch["metadata"][rows])) if "metadata" in batch else None,
            }
            if "messages" in batch:
                payload["messages"] = jsonable(list(batch["messages"][rows]))
            if lengths is not None:
                payload["response_lengths"] = [int(x) for x in lengths[rows]]
            chunks.append(payload)
        with ThreadPoolExecutor(max_workers=self.options.concurrency) as pool:
            answers = list(pool.map(lambda p: self._request("/score", p), chunks))
        out = []
        for payload, answer in zip(chunks, answers):
            out.extend(self._scores_of(answer, len(payload["responses"])))
        return out

    def _scores_of(self, answer, expected: int) -> list[float]:
        """The answer's scores: a list of ``expected`` finite numbers, or a ServiceError naming the field
        and the value."""
        name = self.options.reward
        where = f"rewards['{name}']" if name else "scores"
        if not isinstance(answer, dict):
            raise ServiceError(f"{self.component}: the answer is not a JSON object: {str(answer)[:200]}")
        named = answer.get("rewards")
        values = (named.get(name) if isinstance(named, dict) else None) if name else answer.get("scores")
        if not isinstance(values, list):
            raise ServiceError(f"{self.component}: the answer has no list '{where}': {str(answer)[:200]}")
        if len(values) != expected:
            raise ServiceError(f"{self.component}: the answer has {len(values)} {where} for {expected} responses.")
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ServiceError(f"{self.component}: {where}[{i}] is {str(v)[:100]!r}, not a finite number.")
        return [float(v) for v in values]
