"""``hybridrl serve-reward CONFIG``: the rewards of a run config as an HTTP service.

POST /score  {"prompts": [...], "responses": [...], "answers"?, "metadata"?, "messages"?,
              "response_lengths"?}  ->  {"scores": [...], "rewards": {name: [...]}}
GET  /health ->  {"status": "ok", "rewards": [{"name", "function", "weight"}, ...]}
                 (without the token: {"status": "ok"} alone, a liveness check that says nothing of the setup)

Standard library HTTP server (hybridrl_http.server: Host and Origin checks, the token checked before the
body is read, wrong tokens throttled, request timeouts), one scoring at a time (models are not
re-entrant); bound to 127.0.0.1 unless told otherwise. The command requires a token (``--token``,
``$HYBRIDRL_REWARD_TOKEN``, or a random one it prints) unless ``--no-token``, which it refuses off
localhost: any user of this machine reaches 127.0.0.1, and would otherwise score with these models
(and any API key a judge uses) and move the running statistics of ``normalize: running``.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch
from hybridrl_http.commands import add_server_options, choose_token, require_token
from hybridrl_http.server import ALLOWED_HOSTS_ENV, HttpError, JsonHandler, listen

from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.components import RunContext
from hybridrl.config import RunConfig, load_config
from hybridrl.models import DTYPES, load_tokenizer, resolve_model_path
from hybridrl.shaping import ShapingState

TOKEN_ENV = "HYBRIDRL_REWARD_TOKEN"
DEFAULT_PORT = 8700
MAX_BODY = 64 * 1024 * 1024


class BadRequest(ValueError):
    """The request does not follow the contract; answered with HTTP 400."""


class RewardSet:
    """The rewards of a run config, built once, combined with their weights as the trainer does."""

    def __init__(self, cfg: RunConfig, ctx: RunContext):
        self.ctx = ctx
        self.rewards = [(rc, plugins.lookup("reward function", rc.function)(rc.options, ctx)) for rc in cfg.rewards]
        self.shaping = ShapingState()  # running statistics of normalize=running, for the life of the server
        self.lock = threading.Lock()

    def describe(self) -> list[dict]:
        return [{"name": rc.label, "function": rc.function, "weight": rc.weight} for rc, _ in self.rewards]

    def score(self, request: dict) -> dict:
        batch = request_batch(request)
        with self.lock:
            total = torch.zeros(len(batch))
            out = {}
            for rc, fn in self.rewards:
                try:
                    s = torch.as_tensor(fn.score(batch), dtype=torch.float32).reshape(-1)
                except ValueError as e:
                    raise ValueError(f"reward '{rc.label}' (function '{rc.function}'): {e}") from e
                except Exception as e:
                    raise RuntimeError(f"reward '{rc.label}' (function '{rc.function}') failed: {e!r}") from e
                if s.shape[0] != len(batch):
                    raise RuntimeError(f"reward '{rc.label}' returned {s.shape[0]} scores for {len(batch)} responses.")
                out[rc.label] = s.tolist()
                shaping = getattr(rc, "shaping", None)  # RewardConfig.shaping, where the core defines it
                if shaping is not None and shaping.active:
                    lengths = self._lengths(request, batch) if shaping.length_penalty > 0 else None
                    s = self.shaping.apply(rc.label, s, lengths, shaping)
                total += rc.weight * s
        return {"scores": total.tolist(), "rewards": out}

    def _lengths(self, request: dict, batch: Batch) -> torch.Tensor:
        if request.get("response_lengths") is not None:
            return torch.tensor(request["response_lengths"], dtype=torch.float32)
        if self.ctx.tokenizer is None:
            raise BadRequest("a length penalty is configured: send response_lengths (tokens of each response).")
        ids = self.ctx.tokenizer(batch["response_text"], add_special_tokens=False)["input_ids"]
        return torch.tensor([len(x) for x in ids], dtype=torch.float32)

    def close(self) -> None:
        for _, fn in self.rewards:
            fn.close()


def request_batch(request) -> Batch:
    """The batch a reward scores, from a /score request; BadRequest names what is wrong."""
    if not isinstance(request, dict):
        raise BadRequest("the body must be a JSON object with 'prompts' and 'responses'.")
    responses = request.get("responses")
    if not isinstance(responses, list) or not all(isinstance(r, str) for r in responses):
        raise BadRequest("'responses' must be a list of strings.")
    n = len(responses)
    batch = Batch()
    batch["response_text"] = responses
    fields = {"prompts": "prompt_text", "answers": "answer", "metadata": "metadata", "messages": "messages"}
    for key, name in fields.items():
        value = request.get(key)
        if value is None:
            if key == "prompts":
                raise BadRequest("'prompts' is missing: one prompt per response.")
            if key != "messages":
                batch[name] = [None] * n
            continue
        if not isinstance(value, list) or len(value) != n:
            raise BadRequest(f"'{key}' must be a list of {n} entries, one per response.")
        batch[name] = value
    lengths = request.get("response_lengths")
    if lengths is not None and (not isinstance(lengths, list) or len(lengths) != n):
        raise BadRequest(f"'response_lengths' must be a list of {n} integers.")
    return batch


def make_server(
    rewards: RewardSet,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    allow: tuple[str, ...] = (),
):
    """A server of ``rewards`` (not started: call serve_forever). ``allow``: Host names and origins it
    answers beside the loopback ones and ``$HYBRIDRL_ALLOWED_HOSTS`` (hybridrl_http.server.HostCheck)."""
    require_token("serve-reward", host, token, TOKEN_ENV)

    class Handler(JsonHandler):
        public = frozenset({("GET", "/health")})

        def routes(self):
            return {("GET", "/health"): self._health, ("POST", "/score"): self._score}

        def _health(self) -> dict:
            if not self.authorized:  # public for liveness probes: the setup is the token holder's
                return {"status": "ok"}
            return {"status": "ok", "rewards": rewards.describe()}

        def _score(self, request) -> dict:
            try:
                return rewards.score(request)
            except BadRequest as e:
                raise HttpError(400, str(e)) from None
            except ValueError as e:  # the reward rejects this input: retrying will not help
                raise HttpError(422, str(e)) from None

    return listen(
        "serve-reward",
        host,
        port,
        Handler,
        token=token,
        max_body=MAX_BODY,
        max_body_name=f"{MAX_BODY // 2**20} MiB: send smaller batches",
        allow=allow,
        hint=f"list it with --allow-host or in ${ALLOWED_HOSTS_ENV} to allow it",
    )


def build_context(cfg: RunConfig) -> RunContext:
    """The context rewards are built with, as the trainer would build it (no policy weights)."""
    from hybridrl.devices import resolve_device

    model_path, tokenizer = cfg.model.path, None
    try:
        model_path = resolve_model_path(cfg.model.path, cfg.model.gguf_file)
        tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    except FileNotFoundError as e:
        print(f"warning: serve-reward: {e} Rewards get no policy tokenizer (ctx.tokenizer is None).", file=sys.stderr)
    return RunContext(
        model_path=model_path,
        tokenizer=tokenizer,
        device=resolve_device(cfg.trainer.device),
        dtype=DTYPES[cfg.model.dtype],
        seed=cfg.trainer.seed,
        run_dir=Path(cfg.trainer.run_dir or "runs/serve-reward"),
    )


def add_command(subparsers) -> None:
    p = subparsers.add_parser(
        "serve-reward", help="Serve the rewards of a run config over HTTP (POST /score, GET /health)."
    )
    p.add_argument("config", help="YAML run config; its 'rewards' section is served.")
    p.add_argument("overrides", nargs="*", help="Dotted overrides: rewards.0.batch_size=32")
    add_server_options(p, DEFAULT_PORT, TOKEN_ENV, "score")
    p.set_defaults(func=cmd_serve_reward)


def cmd_serve_reward(args) -> int:
    cfg = load_config(args.config, args.overrides)
    given = args.token or os.environ.get(TOKEN_ENV)
    exposes = "score with these rewards and see their setup"
    token = choose_token("serve-reward", args.host, given, TOKEN_ENV, args.no_token, exposes)  # before any model
    rewards = RewardSet(cfg, build_context(cfg))
    server = make_server(rewards, args.host, args.port, token, tuple(args.allow_host))
    host, port = server.server_address[:2]
    names = ", ".join(f"{r['name']} (x{r['weight']:g})" for r in rewards.describe())
    print(f"serving rewards {names} on http://{host}:{port} (POST /score, GET /health)", flush=True)
    if token:
        made = f"{token}' (a new random token; --token or ${TOKEN_ENV} sets one)"
        shown = "<token>' (the token given)" if given else made
        print(f"serve-reward: send with every request 'Authorization: Bearer {shown}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("serve-reward: stopped", file=sys.stderr)
    finally:
        server.server_close()
        rewards.close()
    return 0
