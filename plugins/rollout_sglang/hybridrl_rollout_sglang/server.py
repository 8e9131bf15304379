"""A running SGLang server as the engine's backend, through its native API over HTTP."""

from __future__ import annotations

import functools
import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybridrl_http.client import ServiceError, get_json, post_json

from hybridrl_rollout_sglang.adapters import checked, server_refusal
from hybridrl_rollout_sglang.backends import WEIGHT_FILES, Backend
from hybridrl_rollout_sglang.protocol import COMPONENT


class Server(Backend):
    """A running SGLang server, through its native API (``/generate``, ``/update_weights_from_disk``).
    With ``in_flight`` (a server without a radix cache) a sync retracts the running requests
    (``/pause_generation``, mode ``retract``: back to the queue with the tokens they have, their keys and
    values freed), loads without flushing a cache (SGLang's scheduler fails on a flush while requests
    wait), and lets them go on (``/continue_generation``), their prompts and tokens prefilled again
    under the new weights. An adapter sync needs no pause: the
    new adapter loads beside the ones requests in flight use (the engine unloads those once unused)."""

    def __init__(self, options, ctx):
        super().__init__(options)
        self.options = options
        self.url = options.base_url.rstrip("/")
        self.component = f"{COMPONENT} (server {self.url})"
        self.can_release = options.release_memory_on_sleep
        self.model_path = ctx.model_path
        self.adapters = ctx.lora.adapters if ctx.lora is not None else 1  # served at once (hybridrl tenants: many)
        self.weights_dir = Path(options.weights_dir or ctx.run_dir / "sglang_weights").absolute()
        self.current: Path | None = None
        try:
            info = get_json(f"{self.url}/get_model_info", **self._http())
        except ServiceError as e:
            raise ServiceError(
                f"{e} Start one with: python -m sglang.launch_server --model-path {ctx.model_path} "
                "--port 30000 (add --enable-memory-saver for release_memory_on_sleep), and set "
                "rollout.base_url to it."
            ) from None
        if isinstance(info, dict) and info.get("is_generation") is False:
            raise ServiceError(f"{self.component}: the server runs an embedding/reward model, not a generator.")
        self.in_flight = self._check_in_flight(ctx)

    def _check_in_flight(self, ctx) -> bool:
        """Whether syncs land while requests run (``in_flight``); 'auto' says once why not, 'on' fails."""
        if self.options.in_flight == "off":
            return False
        why = self._in_flight_refusal(ctx)
        if why and self.options.in_flight == "on":
            raise ServiceError(
                f"{self.component}: rollout.in_flight is 'on', but {why}; or set rollout.in_flight: auto."
            )
        if why and ctx.rank == 0:
            adapters = ctx.lora is not None and ctx.lora.sync != "merged" and not self.can_release
            which = "full-weight syncs (an adapter loads beside those in use)" if adapters else "weight syncs"
            print(f"note: {self.component}: {which} wait for the requests in flight: {why}.", file=sys.stderr,
                  flush=True)  # fmt: skip
        return not why

    def _in_flight_refusal(self, ctx) -> str | None:
        if self.can_release:
            return "release_memory_on_sleep frees the memory that requests in flight hold"
        try:
            self._post("/continue_generation", {})  # nothing to continue: a server that has it answers 200
        except ServiceError as e:
            if "HTTP 404" not in str(e):
                raise
            return f"{self.url} has no /pause_generation and /continue_generation (SGLang 0.5 has them)"
        info = get_json(f"{self.url}/get_server_info", **self._http())
        if isinstance(info, dict) and not info.get("disable_radix_cache", True):
            return (
                f"{self.url} keeps a radix cache, whose prompts' keys and values, computed under the weights before, "
                "requests would reuse after a sync in flight (which cannot flush it while they wait): start it with "
                "--disable-radix-cache"
            )
        return None

    def _http(self, timeout=None):
        o = self.options
        return dict(component=self.component, timeout=timeout or o.timeout, retries=o.retries, token=o.api_key)

    def _post(self, path, payload, timeout=None):
        return post_json(f"{self.url}{path}", payload, **self._http(timeout))

    def generate_many(self, requests: list[dict]) -> list[dict]:
        """Requests in order; up to ``concurrency`` in flight (SGLang batches them continuously)."""
        if len(requests) == 1 or self.options.concurrency == 1:
            return super().generate_many(requests)
        with ThreadPoolExecutor(self.options.concurrency) as pool:
            parts = list(pool.map(self.generate, requests))
        return [item for part in parts for item in part]

    def _generate(self, request):
        out = self._post("/generate", request)
        return out if isinstance(out, list) else [out]

    def _load(self, buckets, version):
        """Save the tensors as a Hugging Face folder and ask the server to load it from disk."""
        from safetensors.torch import save_file

        folder = self.weights_dir / f"v{version:06d}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for f in Path(self.model_path).iterdir():  # config, generation config, tokenizer
            if f.is_file() and not f.name.endswith(WEIGHT_FILES) and not f.name.endswith(".index.json"):
                shutil.copy2(f, folder / f.name)
        weight_map, total = {}, 0
        for k, bucket in enumerate(buckets):
            name = f"model-{k + 1:05d}.safetensors"
            tensors = {n: t.detach().to("cpu").contiguous() for n, t in bucket}
            save_file(tensors, str(folder / name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(tensors, name)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        seen_by_server = folder
        if self.options.server_weights_dir:
            seen_by_server = Path(self.options.server_weights_dir) / folder.name
        payload = {"model_path": str(seen_by_server)}
        if self.in_flight:  # a flush with requests waiting fails SGLang's scheduler: "Cache flush failed after ..."
            payload |= {"weight_version": str(version), "flush_cache": False}
        if self.in_flight:  # the running requests back to the queue, their tokens kept
            self._post("/pause_generation", {"mode": "retract"})
        try:
            ret = self._post("/update_weights_from_disk", payload)
        except ServiceError as e:
            raise ServiceError(
                f"{e} The server must see {seen_by_server} (a shared file system; set "
                "rollout.server_weights_dir when it mounts rollout.weights_dir elsewhere)."
            ) from None
        finally:
            if self.in_flight:
                self._post("/continue_generation", {})
        if isinstance(ret, dict) and ret.get("success") is False:
            raise ServiceError(f"{self.component}: update_weights_from_disk failed: {ret.get('message')}")
        if self.current is not None and self.current != folder:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = folder

    @functools.cache  # noqa: B019 - one server a backend, asked once
    def loras_per_batch(self):
        info = get_json(f"{self.url}/get_server_info", **self._http())
        return int(info.get("max_loras_per_batch") or 8) if isinstance(info, dict) else 1  # SGLang's default: 8

    def adapter_refusal(self, config):
        if self.can_release:
            return "release_memory_on_sleep may drop the server's base weights, which adapter syncs never send again"
        info = get_json(f"{self.url}/get_server_info", **self._http())
        held = info.get("max_loaded_loras") if isinstance(info, dict) else None
        if held is not None and 1 < self.adapters and held <= self.adapters:  # each newest, one more as one loads
            return (
                f"it holds {held} adapters at once (--max-loaded-loras) and the run serves {self.adapters} (one per "
                f"tenant), each beside its next version as that loads: start it with --max-loaded-loras "
                f"{self.adapters + 1} or more"
            )
        return server_refusal(info, config)

    def _load_adapter(self, adapter, name):
        """peft's folder under weights_dir/adapters, loaded by the server under ``name``."""
        folder = adapter.save(self.weights_dir / "adapters" / name)
        seen = Path(self.options.server_weights_dir) / "adapters" / name if self.options.server_weights_dir else folder
        checked(self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(seen)}), self.component,
                f"loading adapter {name} from {seen}")  # fmt: skip

    def unload_adapter(self, name):
        """Unload ``name``, unless the server did (its --max-loaded-loras evicts the least recently used)."""
        try:
            self._post("/unload_lora_adapter", {"lora_name": name})
        except ServiceError as e:
            if "does not exist" not in str(e):
                raise
        shutil.rmtree(self.weights_dir / "adapters" / name, ignore_errors=True)

    def _release(self, tags):
        self._post("/release_memory_occupation", {} if tags is None else {"tags": tags})

    def _resume(self, tags):
        self._post("/resume_memory_occupation", {} if tags is None else {"tags": tags})
