"""What the Tinker API does, over one run: training clients (LoRA adapters over the run's frozen
base, :mod:`hybridrl_tinker.adapters`), their calls in order (:mod:`hybridrl_tinker.futures`),
sampling through the run's engine session, checkpoints as adapter folders under
``RUN_DIR/tinker/<model_id>/{weights,sampler_weights}/<name>``.

Each method takes a request as the SDK sends it (JSON as a dict; ``forward_backward`` as
protobuf bytes) and returns the reply: a dict, or for a long call a future's ``{"request_id"}``,
whose result :meth:`TinkerService.result` gives. The HTTP side is :mod:`hybridrl_tinker.server`.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import torch

from hybridrl_tinker import adapters, losses, wire
from hybridrl_tinker.futures import Future, UserError, Worker
from hybridrl_tinker.sampling import Sampler, prompt_tokens, sampling_params

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")  # a checkpoint's name: one folder, never '..'
MODEL_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}:train:[0-9]{1,9}")
KINDS = {"weights": "training state", "sampler_weights": "sampler weights"}
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def need(body: dict, key: str, kind=str):
    value = body.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise UserError(f"the request needs {key!r} ({getattr(kind, '__name__', kind)})")
    return value


class TinkerService:
    """The Tinker API over ``run`` (built with ``data=False``): see the module docstring."""

    def __init__(self, run, options, model_name: str):
        self.run, self.options = run, options
        self.names = [model_name, *[n for n in options.model_names if n != model_name]]
        self.slots = adapters.Slots(run.policy)
        self.root = Path(run.run_dir) / "tinker"
        self.tenants: dict[str, adapters.Tenant] = {}
        self.samplers: dict[str, Sampler] = {}
        self.loaded: tuple | None = None  # what the engine holds: (sampler id, snapshot id)
        self.syncs = 0
        self.base = self.slots.fresh(0, lambda name: False)  # lora_B zero: the base model
        self.worker = Worker(self._sample)

    # -- sessions and configuration -----------------------------------------------------------

    @staticmethod
    def client_config(body: dict) -> dict:
        return {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }

    @staticmethod
    def create_session(body: dict) -> dict:
        return {"session_id": f"session-{uuid.uuid4().hex[:16]}"}

    def capabilities(self) -> dict:
        length = self.run.engine.context_length()
        return {"supported_models": [{"model_name": n, "max_context_length": length} for n in self.names]}

    def base_name(self, name: str) -> str:
        """``name`` if the server serves it (a client may add ``:suffix``), else a UserError listing the names."""
        if name.split(":")[0] not in self.names:
            raise UserError(f"base model {name!r} is not served here; this server trains {', '.join(self.names)}")
        return name.split(":")[0]

    # -- models ---------------------------------------------------------------------------------

    def create_model(self, body: dict) -> dict:
        session, seq = need(body, "session_id"), need(body, "model_seq_id", int)
        base = self.base_name(need(body, "base_model"))
        config = body.get("lora_config") or {}
        rank = config.get("rank", 32)
        if rank != self.slots.rank:
            raise UserError(
                f"lora rank {rank} asked; this server trains rank-{self.slots.rank} adapters (model.lora.r in its "
                f"config): create_lora_training_client(..., rank={self.slots.rank})"
            )
        if (body.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
            raise UserError("only the adamw optimizer is served")
        model_id = f"{session}:train:{seq}"
        train = {g for g in adapters.GROUPS if config.get(f"train_{g}", True)}

        def make():
            self._room(model_id)
            params = self.slots.fresh(config.get("seed"), lambda name: adapters.group_of(name) in train)
            self.tenants[model_id] = adapters.Tenant(base, params, train)
            self.tenants[model_id].metadata = body.get("user_metadata") or {}
            return {"model_id": model_id}

        return self._future(self.worker.submit(make), model_id)

    def _room(self, model_id: str) -> None:
        if model_id not in self.tenants and len(self.tenants) >= self.options.max_models:
            raise UserError(
                f"this server holds {len(self.tenants)} training clients, its most (tinker.max_models); "
                "unload one (its client's unload_model) or raise tinker.max_models"
            )

    def tenant(self, model_id: str) -> adapters.Tenant:
        if model_id not in self.tenants:
            raise UserError(f"no training client {model_id!r} here (a restart forgets them: load a checkpoint)")
        return self.tenants[model_id]

    def get_info(self, body: dict) -> dict:
        model_id = need(body, "model_id")
        tenant = self.tenant(model_id)
        data = {"arch": type(self.run.model_config).__name__, "model_name": tenant.base_model}
        data["tokenizer_id"] = self.run.ctx.model_path  # the SDK's get_tokenizer loads it: the folder on this machine
        return {"model_id": model_id, "model_data": data, "is_lora": True, "lora_rank": self.slots.rank,
                "model_name": tenant.base_model, "optimizer_config": {"type": "adamw"}}  # fmt: skip

    def unload_model(self, body: dict) -> dict:
        model_id = need(body, "model_id")
        return self._future(self.worker.submit(lambda: self.tenants.pop(model_id, None) and {"model_id": model_id}))

    def forward_backward(self, body: bytes) -> dict:
        try:
            request = wire.read_forward_backward(body)
        except wire.WireError as e:
            raise UserError(f"forward_backward: {e}") from None
        self.tenant(request.model_id)
        run = lambda: self._forward_backward(request)  # noqa: E731
        return self._future(self.worker.submit_train(request.model_id, request.seq_id, run))

    def optim_step(self, body: dict) -> dict:
        model_id, seq = need(body, "model_id"), need(body, "seq_id", int)
        if "adam_params" not in body:
            raise UserError("only Adam's parameters (adam_params) are served")
        adam = ADAM | {k: float(v) for k, v in body["adam_params"].items() if k in ADAM}
        run = lambda: {"metrics": self.tenant(model_id).optim_step(adam)}  # noqa: E731
        return self._future(self.worker.submit_train(model_id, seq, run))

    # -- forward and backward ---------------------------------------------------------------------

    def _forward_backward(self, request: wire.ForwardBackwardRequest) -> bytes:
        tenant = self.tenant(request.model_id)
        self.slots.use(tenant.params)
        vocab = self.run.model_config.get_text_config().vocab_size
        for i, d in enumerate(request.data):
            self._check_datum(i, d, vocab)
        budget = max(1, 2**28 // vocab)  # tokens a pass: its float32 logits stay near 1 GiB
        outputs, total = [], 0.0
        for part in micro_batches(request.data, budget):
            lps = self._target_logprobs(part, grad=not request.forward_only)
            try:
                part_losses = [losses.loss(request.loss_fn, lp, d.inputs, request.config) for d, lp in zip(part, lps)]
            except ValueError as e:
                raise UserError(str(e)) from None
            loss = torch.stack(part_losses).sum()
            if not request.forward_only:
                loss.backward()
            total += float(loss.detach())
            outputs += [{"logprobs": lp.detach().float().cpu()} for lp in lps]
        return wire.forward_backward_output(outputs, {"loss:sum": total})

    def _check_datum(self, i: int, d: wire.Datum, vocab: int) -> None:
        target = d.inputs.get("target_tokens")
        if not d.tokens:
            raise UserError(f"datum {i}: the model input is empty")
        if target is None or target.dim() not in (1, 2) or target.shape[0] != len(d.tokens):
            got = "none" if target is None else tuple(target.shape)
            raise UserError(f"datum {i}: target_tokens must have one row per input token ({len(d.tokens)}); got {got}")
        ids = torch.tensor(d.tokens)
        for what, t in (("model input", ids), ("target_tokens", target)):
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
                raise UserError(f"datum {i}: a token id of its {what} is outside the vocabulary (0..{vocab - 1})")

    def _target_logprobs(self, part: list[wire.Datum], grad: bool) -> list[torch.Tensor]:
        """Each datum's logprobs of its target tokens at every position, one padded pass: one
        log-softmax over the pass's logits and one gather of every target (a slice per datum of the
        logits would give each its own full-size gradient in the backward pass)."""
        device = self.run.ctx.device
        width = max(len(d.tokens) for d in part)
        k = max(d.inputs["target_tokens"].reshape(len(d.tokens), -1).shape[1] for d in part)  # top-K targets: K
        ids = torch.full((len(part), width), self.run.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        targets = torch.zeros((len(part), width, k), dtype=torch.long)
        for i, d in enumerate(part):
            ids[i, : len(d.tokens)] = torch.tensor(d.tokens)
            mask[i, : len(d.tokens)] = 1
            t = d.inputs["target_tokens"].reshape(len(d.tokens), -1)
            targets[i, : len(d.tokens), : t.shape[1]] = t
        with torch.set_grad_enabled(grad), self.run.strategy.autocast():
            logits = self.run.policy(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            chosen = logits.float().log_softmax(-1).gather(-1, targets.to(device))  # (rows, width, k)
        out = []
        for i, d in enumerate(part):
            shape = d.inputs["target_tokens"].shape
            out.append(chosen[i, : len(d.tokens), : (shape[1] if len(shape) == 2 else 1)].reshape(shape))
        return out

    # -- checkpoints ------------------------------------------------------------------------------

    def folder(self, path: str, kind: str | None = None) -> Path:
        """The folder of ``tinker://<model_id>/<kind>/<name>``, or a UserError saying what a path looks like."""
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or not MODEL_ID.fullmatch(parts[0]) or parts[1] not in KINDS or not NAME.fullmatch(parts[2]):
            raise UserError(
                f"not a checkpoint path of this server: {path[:200]!r} (tinker://<model_id>/weights/<name>)"
            )
        if kind and parts[1] != kind:
            raise UserError(f"{path} holds {KINDS[parts[1]]}; this call needs {KINDS[kind]} (tinker://.../{kind}/...)")
        return self.root.joinpath(*parts)

    def save_weights(self, body: dict) -> dict:
        model_id, seq, name = need(body, "model_id"), need(body, "seq_id", int), need(body, "path")
        path = f"tinker://{model_id}/weights/{name}"
        folder = self.folder(path)
        tenant = self.tenant(model_id)

        def save():
            state = {"base_model": tenant.base_model, "train": sorted(tenant.train), "step": tenant.step}
            state |= {"rank": self.slots.rank, "model_id": model_id, "metadata": body.get("user_metadata") or {}}
            try:
                adapters.write_folder(folder, self.slots, tenant.params, state, tenant.optimizer, body.get("overwrite"))
            except FileExistsError as e:
                raise UserError(str(e)) from None
            return {"path": path}

        return self._future(self.worker.submit_train(model_id, seq, save))

    def save_weights_for_sampler(self, body: dict) -> dict:
        model_id, seq = need(body, "model_id"), need(body, "seq_id", int)
        tenant, name = self.tenant(model_id), body.get("path")
        if name is None:  # the SDK's save_weights_and_get_sampling_client: a snapshot in memory

            def snapshot():
                sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
                self.samplers[sampler_id] = Sampler(tenant.base_model, tensors=tenant.snapshot(), model_id=model_id)
                self._expire(model_id)
                return {"sampling_session_id": sampler_id}

            return self._future(self.worker.submit_train(model_id, seq, snapshot))
        path = f"tinker://{model_id}/sampler_weights/{name}"
        folder = self.folder(path)

        def save():
            try:
                adapters.write_folder(folder, self.slots, tenant.snapshot(), None, overwrite=body.get("overwrite"))
            except FileExistsError as e:
                raise UserError(str(e)) from None
            return {"path": path}

        return self._future(self.worker.submit_train(model_id, seq, save))

    def _expire(self, model_id: str) -> None:
        """Keep the newest tinker.sampler_snapshots unnamed snapshots of a model; older ones expire."""
        mine = [s for s in self.samplers.values() if s.model_id == model_id and s.tensors is not None]
        for s in mine[: -self.options.sampler_snapshots]:
            s.tensors, s.expired = None, True

    def load_weights(self, body: dict) -> dict:
        path = need(body, "path")
        folder = self.folder(path, "weights")
        if not (folder / "state.json").is_file():
            raise UserError(f"no training state saved at {path}")
        with_optimizer = bool(body.get("optimizer"))
        if "model_id" in body:  # the legacy call: into an existing model, in its order
            model_id, seq = need(body, "model_id"), need(body, "seq_id", int)
        else:
            model_id, seq = f"{need(body, 'session_id')}:train:{need(body, 'model_seq_id', int)}", None

        def load():
            self._room(model_id)
            try:
                tenant = adapters.restore(folder, self.slots, path, with_optimizer)
            except ValueError as e:
                raise UserError(str(e)) from None
            self.base_name(tenant.base_model)
            self.tenants[model_id] = tenant
            return {"model_id": model_id, "path": path}

        future = self.worker.submit(load) if seq is None else self.worker.submit_train(model_id, seq, load)
        return self._future(future, model_id)

    def weights_info(self, body: dict) -> dict:
        path = need(body, "tinker_path")
        folder = self.folder(path)
        state = folder / "state.json"
        if not (folder / "adapter_config.json").is_file():
            raise UserError(f"nothing saved at {path}")
        saved = json.loads(state.read_text()) if state.is_file() else {}
        base = saved.get("base_model") or self.names[0]
        return {"base_model": base, "is_lora": True, "lora_rank": self.slots.rank} | {
            f"train_{g}": g in saved.get("train", adapters.GROUPS) for g in adapters.GROUPS
        }

    # -- sampling -----------------------------------------------------------------------------

    def create_sampling_session(self, body: dict) -> dict:
        path, base = body.get("model_path"), body.get("base_model")
        if path:
            folder = self.folder(path, "sampler_weights")
            if not (folder / "adapter_model.safetensors").is_file():
                raise UserError(f"no sampler weights saved at {path}")
            sampler = Sampler(self.names[0], path=path)
        elif base:
            sampler = Sampler(self.base_name(base))
        else:
            raise UserError("create_sampling_session needs model_path (tinker://...) or base_model")
        sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
        self.samplers[sampler_id] = sampler
        return {"sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> dict:
        s = self.samplers.get(sampler_id)
        if s is None:
            raise UserError(f"no sampling session {sampler_id!r} on this server")
        return {"sampler_id": sampler_id, "base_model": s.base_model} | ({"model_path": s.path} if s.path else {})

    def asample(self, body: dict) -> dict:
        sampler_id = need(body, "sampling_session_id")
        self.get_sampler(sampler_id)
        prompt = prompt_tokens(body.get("prompt"))
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024:
            raise UserError("num_samples must be a whole number from 1 to 1024")
        sampling = sampling_params(body.get("sampling_params") or {}, n, self.run.tokenizer, self.run.config)
        logprobs = bool(body.get("prompt_logprobs"))
        topk = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")
        if any(body.get(k) for k in topk):
            raise UserError(f"top-k logprobs are not served: {', '.join(topk)}")
        key = (sampler_id, sampling.model_dump_json(), logprobs)
        future = self.worker.submit_sample(key, (prompt, sampling, logprobs))
        ids = [f"{future.request_id}:{i}" for i in range(n)]
        return {"request_id": future.request_id, "sample_sequence_ids": ids}

    def _weights(self, sampler_id: str) -> tuple[tuple, dict]:
        s = self.samplers[sampler_id]
        if s.expired:
            raise UserError(
                f"sampling session {sampler_id} has expired: the model has made tinker.sampler_snapshots newer "
                "snapshots since; sample from a newer one, or save named sampler weights"
            )
        if s.tensors is not None:
            return (sampler_id,), s.tensors
        if s.path is None:
            return ("base",), self.base
        return (s.path,), adapters.read_folder(self.folder(s.path), self.slots, s.path)

    def _sample(self, futures: list[Future]) -> list[bytes]:
        """Futures of one sampler and one set of settings, in one engine call (the worker's)."""
        sampler_id = futures[0].key[0]
        key, tensors = self._weights(sampler_id)
        self._load(key, tensors)
        prompts = [f.args[0] for f in futures]
        sampling = futures[0].args[1]
        out = self.run.session.generate(prompts, sampling, "generate (tinker asample)")
        scored = self._prompt_logprobs(prompts, tensors) if futures[0].args[2] else [None] * len(prompts)
        results, n = [], sampling.n
        for i in range(len(futures)):
            rows = range(i * n, i * n + n)
            seqs = [(out.token_ids[r], out.logprobs[r], out.finish_reasons[r]) for r in rows]
            results.append(wire.sample_response(seqs, scored[i]))
        return results

    def _load(self, key: tuple, tensors: dict) -> None:
        """The engine takes ``tensors`` unless it holds them: the adapter alone or merged weights (model.lora.sync)."""
        if self.loaded == key:
            return
        self.slots.use(tensors)
        self.syncs += 1
        session = self.run.session
        if session.adapters:
            session.sync(lambda: self.slots.adapter(tensors, self.syncs), update=False)
        else:
            session.sync(lambda: self.run_tensors(), update=False)
        self.loaded = key

    def run_tensors(self):
        from hybridrl import lora
        from hybridrl.engine_weights import engine_tensors

        run = self.run
        named = lora.merged_tensors(run.strategy.full_tensors(run.policy), self.slots.layers)
        return engine_tensors(run.policy, named, run.engine.weight_format)

    @torch.no_grad()
    def _prompt_logprobs(self, prompts: list[list[int]], tensors: dict) -> list[list[float | None]]:
        """Each prompt's logprob of every token after the first (None for the first), scored by the
        trainer under ``tensors`` (compute_logprobs), in passes of about 1 GiB of logits."""
        self.slots.use(tensors)
        data = [wire.Datum(p, {"target_tokens": torch.tensor(p[1:] + [0])}) for p in prompts]
        budget = max(1, 2**28 // self.run.model_config.get_text_config().vocab_size)
        out = []
        for part in micro_batches(data, budget):
            out += [[None, *lp.float().cpu().tolist()[:-1]] for lp in self._target_logprobs(part, grad=False)]
        return out

    # -- futures ----------------------------------------------------------------------------------

    @staticmethod
    def _future(f: Future, model_id: str | None = None) -> dict:
        return {"request_id": f.request_id} | ({"model_id": model_id} if model_id else {})

    def result(self, body: dict, wait_s: float) -> tuple[str, object]:
        """``("proto", bytes)``, ``("json", dict)`` for a result or a failure, or ``("json", try_again)``
        after ``wait_s`` seconds without one."""
        request_id = need(body, "request_id")
        f = self.worker.get(request_id)
        if f is None:
            raise UserError(f"no request {request_id!r} here (results are kept an hour; a restart forgets them)")
        if not f.done.wait(wait_s):
            return "json", {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if f.error:
            return "json", {"error": f.error[0], "category": f.error[1]}
        return ("proto", f.result) if isinstance(f.result, bytes) else ("json", f.result)

    def close(self) -> None:
        self.worker.stop()


def micro_batches(data: list, budget: int) -> list[list]:
    """``data`` in order, in groups whose padded size (rows x longest) stays within ``budget`` tokens."""
    groups, group, width = [], [], 0
    for d in data:
        w = max(width, len(d.tokens))
        if group and w * (len(group) + 1) > budget:
            groups.append(group)
            group, w = [], len(d.tokens)
        group.append(d)
        width = w
    return [*groups, group] if group else groups
