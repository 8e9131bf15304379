"""Contract fakes of SGLang for the contract tests: SGLang itself cannot run on CPU machines.

``ContractSGLang`` generates with a REAL transformers model the way SGLang's sampler does
(``sglang/srt/layers/sampler.py``, 0.5.x: logits / temperature, softmax over the whole
vocabulary, top-k/top-p applied only to draw the token, logprob = log of the full
temperature-scaled probability) and answers in SGLang's output format. Two faces:

- ``sglang_server``: an HTTP server on 127.0.0.1 with the subset of SGLang's native API the
  plugin uses (``/generate``, ``/get_model_info``, ``/health``, ``/update_weights_from_disk``,
  ``/release_memory_occupation``, ``/resume_memory_occupation``, ``/flush_cache``, LoRA's
  ``/get_server_info``, ``/load_lora_adapter``, ``/unload_lora_adapter``, and for syncs in flight
  ``/pause_generation`` in mode ``retract`` (running requests wait between two decoding steps, their
  tokens kept, and are prefilled again where the weights changed) and ``/continue_generation``),
  status codes and bodies as in ``sglang/srt/entrypoints/http_server.py``;
- ``sglang_module``: a stand-in ``sglang`` module whose ``Engine`` has the signatures of
  ``sglang.Engine`` (``generate``, ``update_weights_from_tensor``, ``update_weights_from_disk``,
  ``release_memory_occupation``, ``resume_memory_occupation``, ``shutdown``, and LoRA's
  ``load_lora_adapter``, ``load_lora_adapter_from_tensors``, ``unload_lora_adapter``), including
  the calls that worked with SGLang 0.5.17 on a GPU.

LoRA as SGLang serves it (``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``): adapters
loaded under a name, from a peft folder or tensors, refused when LoRA is off, their rank above the
maximum or a target outside the modules given; a request names its adapter in ``lora_path``, an
unknown name is an error. The fake computes ``W + (alpha / r) B A`` for the call's adapter.

Released weights are overwritten with noise, as SGLang's memory saver (without a CPU backup)
gives back memory whose content is lost; loading weights or generating into released memory
is an error, where the real engine would crash.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import shutil
import sys
import tempfile
import threading
import time
import types
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from hybridrl.engine_weights import checkpoint_tensors
from hybridrl.engines import layer_of
from hybridrl.models import position_ids

# sglang/srt/sampling/sampling_params.py (0.5.x): the keys SamplingParams accepts
SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}  # fmt: skip
# ServerArgs fields the plugin or the recipe passes (sglang/srt/server_args.py)
ENGINE_KEYS = {
    "model_path", "skip_tokenizer_init", "mem_fraction_static", "tp_size", "dtype", "random_seed",
    "enable_memory_saver", "log_level", "context_length", "attention_backend", "base_gpu_id",
    "cuda_graph_max_bs_decode", "cuda_graph_max_bs", "enable_deterministic_inference", "disable_cuda_graph",
    "enable_weights_cpu_backup", "trust_remote_code", "port", "nccl_port",
} | {"enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch"}  # fmt: skip
LORA_KEYS = ("enable_lora", "max_lora_rank", "lora_target_modules")
TAGS = {"weights", "kv_cache", "cuda_graph"}
# what SGLang takes from generation_config.json for the fields a request leaves out, with its default
# --sampling-defaults model (sglang/srt/configs/model_config.py, get_default_sampling_params)
MODEL_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class ContractSGLang:
    """SGLang's generation and weight/memory API over a real transformers model (contract fake)."""

    def __init__(self, model_path: str, seed: int = 0, with_tokenizer: bool = True, cpu_backup: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        gen = Path(model_path) / "generation_config.json"
        file = json.loads(gen.read_text()) if gen.is_file() else {}
        self.model_defaults = {k: file[k] for k in MODEL_DEFAULT_KEYS if k in file}
        # eager: the model as its checkpoint defines it, as SGLang computes it (transformers' SDPA leaves
        # Gemma-2's attention soft-cap out); LongRoPE's factors picked per batch by the longest
        # position, as SGLang picks them
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        # what SGLang's load_weights takes: the checkpoint's names and layouts
        self.checkpoint = dict(checkpoint_tensors(self.model, self.model.state_dict().items()))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path) if with_tokenizer else None
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # a paused generation waits on it, the lock released
        self.paused = False  # /pause_generation (mode retract) until /continue_generation
        self.waiting = 0  # requests in the queue while paused: retracted, or come in meanwhile
        self.weights_version = 0  # weights loaded since the start
        self.step_hook = None  # called with this object between two decoding steps, the lock held (tests)
        self.released: set[str] = set()
        self.cpu_backup = cpu_backup  # enable_weights_cpu_backup: released weights come back on resume
        self.backup: dict[str, torch.Tensor] | None = None
        self.calls: list[tuple] = []  # (name, detail) of every call, in order
        self.lora: dict = {}  # enable_lora, max_lora_rank, lora_target_modules as the engine started
        self.adapters: dict[str, tuple[dict, dict]] = {}  # name -> (peft config, tensors)
        self.serving: collections.Counter[str] = collections.Counter()  # generate calls running on each adapter

    # -- generation ------------------------------------------------------------------------
    def generate(self, input_ids, sampling_params=None, return_logprob=False, lora_path=None) -> list[dict] | dict:
        if input_ids is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        rows = [input_ids] if single else input_ids
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(rows)
        params = [{**self.model_defaults, **p} for p in params]
        if len(params) != len(rows):
            raise ValueError(f"{len(params)} sampling_params for {len(rows)} prompts.")
        for p in params:
            unknown = set(p) - SAMPLING_KEYS
            if unknown:
                raise ValueError(f"Unknown sampling parameters {sorted(unknown)}.")
            if p.get("stop") and self.tokenizer is None:
                raise ValueError(f"stop={p['stop']!r} is unavailable when skip_tokenizer_init=True.")
            if p.get("n", 1) != 1 or p.get("min_p", 0) or p.get("repetition_penalty", 1) != 1:
                raise NotImplementedError("the contract fake implements n=1, min_p=0 and no penalties")
        each = lora_path if isinstance(lora_path, list) else [lora_path] * len(rows)  # a request's adapter
        names = list(dict.fromkeys(each))
        missing = [n for n in names if n is not None and n not in self.adapters]
        if missing:
            raise ValueError(f"The following requested LoRA adapters are not loaded: {', '.join(missing)}")
        with self.lock:
            self._wait_while_paused()  # a new request waits in the queue
            if self.released & {"kv_cache", "weights"}:
                raise RuntimeError(f"generate with released memory {sorted(self.released)}")
            self.calls.append(("generate", len(rows), *(n for n in names if n)))
            self.serving.update(names)
            try:  # each request with its adapter (SGLang's batches mix them): the rows of each in turn
                out = [None] * len(rows)
                for name in names:
                    mine = [i for i, n in enumerate(each) if n == name]
                    with self._adapted(name):
                        part = self._generate([list(rows[i]) for i in mine], [params[i] for i in mine], return_logprob)
                    for i, item in zip(mine, part, strict=True):
                        out[i] = item
            finally:
                self.serving.subtract(names)
                self.cond.notify_all()
        return out[0] if single else out

    # -- LoRA (sglang/srt/lora, 0.5.x) -------------------------------------------------------
    def load_adapter(self, name: str, config: dict, tensors: dict) -> dict:
        """load_lora_adapter(_from_tensors): LoRAUpdateOutput's fields."""
        if not self.lora.get("enable_lora"):
            return self._lora_result(False, "LoRA is not enabled. Launch the server with --enable-lora.")
        if name in self.adapters:
            return self._lora_result(False, f"LoRA adapter {name} is already loaded.")
        rank = max(t.shape[0] for k, t in tensors.items() if ".lora_A." in k)
        if rank > (self.lora.get("max_lora_rank") or 0):
            return self._lora_result(False, f"LoRA rank {rank} exceeds max_lora_rank {self.lora.get('max_lora_rank')}.")
        modules = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors}
        allowed = self.lora.get("lora_target_modules") or []
        if "all" not in allowed and not modules <= set(allowed):
            return self._lora_result(False, f"LoRA target modules {sorted(modules - set(allowed))} are not enabled.")
        with self.lock:
            self.calls.append(("load_lora_adapter", name))
            self.adapters[name] = (dict(config), {k: v.detach().float().clone() for k, v in tensors.items()})
            most = self.lora.get("max_loaded_loras")
            while most is not None and len(self.adapters) > most:  # SGLang evicts the least recently used,
                oldest = next(iter(self.adapters))  # once no running request uses it
                if self.serving[oldest]:
                    self.cond.wait()  # meanwhile the client may unload it: look again
                    continue
                self.calls.append(("evict_lora_adapter", oldest))
                del self.adapters[oldest]
        return self._lora_result(True, "")

    def unload_adapter(self, name: str) -> dict:
        """SGLang's LoRA registry unregisters the name, then waits until no running request uses it."""
        with self.lock:
            while self.serving[name]:
                self.cond.wait()
            if self.adapters.pop(name, None) is None:  # SGLang's registry's words
                loaded = list(self.adapters)
                return self._lora_result(False, f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}")
            self.calls.append(("unload_lora_adapter", name))
        return self._lora_result(True, "")

    def _lora_result(self, success: bool, message: str) -> dict:
        return {"success": success, "error_message": message, "loaded_adapters": {n: n for n in self.adapters}}

    @contextlib.contextmanager
    def _adapted(self, name):
        """The model with ``name``'s adapter added to its weights for one call."""
        from transformers.pytorch_utils import Conv1D

        if name is None:
            yield
            return
        config, tensors = self.adapters[name]
        modules, saved = dict(self.model.named_modules()), []
        with torch.no_grad():
            for key, a in tensors.items():
                if ".lora_A." not in key:
                    continue
                module = modules[key.removeprefix("base_model.model.").split(".lora_A.")[0]]
                b, r = tensors[key.replace(".lora_A.", ".lora_B.")], a.shape[0]
                alpha = config.get("lora_alpha", r)
                delta = (alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r) * (b @ a)
                saved.append((module.weight, module.weight.detach().clone()))
                module.weight.add_(delta.T if isinstance(module, Conv1D) else delta)  # Conv1D stores (in, out)
        try:
            yield
        finally:
            with torch.no_grad():
                for weight, before in saved:
                    weight.copy_(before)

    @torch.no_grad()
    def _generate(self, rows, params, return_logprob):
        B = len(rows)
        limit = [p.get("max_new_tokens", 128) for p in params]
        new: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        finish: list[dict | None] = [None] * B
        gens = [
            torch.Generator().manual_seed(p["sampling_seed"]) if p.get("sampling_seed") is not None else None
            for p in params
        ]
        P = max(map(len, rows))
        ids = torch.zeros(B, P, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):  # left-padded, as the trainer's batch
            ids[i, P - len(r) :] = torch.tensor(r)
            mask[i, P - len(r) :] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True)
        version, fed = self.weights_version, []
        while True:
            logits, past = out.logits[:, -1].float(), out.past_key_values
            step = [0] * B  # finished rows are fed a padding token their mask hides
            for i in range(B):
                if finish[i] is not None:
                    continue
                p = params[i]
                probs = torch.softmax(logits[i] / p.get("temperature", 1.0), dim=-1)
                token = self._draw(probs, p.get("top_k", -1), p.get("top_p", 1.0), gens[i] or self.generator)
                new[i].append(token)
                lps[i].append(float(torch.log(probs[token])))
                finish[i] = self._finished(new[i], p, limit[i])
                step[i] = token
            if all(f is not None for f in finish):
                break
            live = torch.tensor([[int(f is None)] for f in finish])
            mask = torch.cat([mask, live], dim=1)
            fed.append(torch.tensor(step)[:, None])
            if self._retracted(version):  # new weights: the prompts and tokens so far prefilled again
                version = self.weights_version
                full = torch.cat([ids, *fed], dim=1)
                out = self.model(input_ids=full, attention_mask=mask, position_ids=position_ids(mask), use_cache=True)
                continue
            out = self.model(
                input_ids=fed[-1],
                attention_mask=mask,
                position_ids=mask.sum(-1, keepdim=True) - 1,
                past_key_values=past,
                use_cache=True,
            )
        out = []
        for i in range(B):
            p, ids, fr = params[i], new[i], finish[i]
            output_ids = list(ids)
            if isinstance(fr.get("matched"), int) and not p.get("no_stop_trim", False):
                output_ids = output_ids[:-1]  # SGLang trims a matched stop token unless no_stop_trim
            meta = {
                "id": uuid.uuid4().hex,
                "finish_reason": fr,
                "prompt_tokens": len(rows[i]),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
            }
            if return_logprob:
                meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(lps[i], ids)]
                meta["input_token_logprobs"] = [(None, rows[i][-1], None)]
            item = {"output_ids": output_ids, "meta_info": meta}
            if self.tokenizer is not None:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                if isinstance(fr.get("matched"), str) and not p.get("no_stop_trim", False):
                    text = text[: text.find(fr["matched"])]
                item = {"text": text, **item}
            out.append(item)
        return out

    def _retracted(self, version: int) -> bool:
        """Between two decoding steps: while generation is paused (mode retract) the request waits
        in the queue with its tokens, the lock released; True where the weights changed meanwhile (its
        KV cache is then computed again, as SGLang prefills a retracted request)."""
        if self.step_hook is not None:
            self.step_hook(self)
        if self.paused:
            self.calls.append(("retracted",))
        self._wait_while_paused()
        return self.weights_version != version

    def _wait_while_paused(self) -> None:
        if not self.paused:
            return
        self.waiting += 1
        while self.paused:
            self.cond.wait()
        self.waiting -= 1

    def flush_cache(self) -> bool:
        """SGLang's scheduler flushes its caches only with no request running or waiting (an update's
        flush that cannot asserts, and the server dies: "Cache flush failed after updating weights")."""
        return not self.waiting

    def pause(self, mode: str) -> None:
        if mode != "retract":
            raise NotImplementedError("the contract fake pauses in mode retract")
        with self.cond:
            self.paused = True
            self.calls.append(("pause_generation", mode))
            self.cond.notify_all()
            deadline = time.monotonic() + 30  # as SGLang's, it answers once the running requests are back in the queue
            while self.waiting < sum(self.serving.values()) and time.monotonic() < deadline:
                self.cond.wait(0.01)

    def go_on(self) -> None:
        with self.cond:
            self.paused = False
            self.calls.append(("continue_generation",))
            self.cond.notify_all()

    @staticmethod
    def _draw(probs, top_k, top_p, generator) -> int:
        """SGLang's torch fallback: top-k and top-p on a sorted copy; probs stay untouched."""
        sorted_probs, index = probs.sort(descending=True)
        cut = sorted_probs.clone()
        cut[(sorted_probs.cumsum(-1) - sorted_probs) > top_p] = 0.0
        if 0 < top_k < len(cut):
            cut[top_k:] = 0.0
        return int(index[torch.multinomial(cut / cut.sum(), 1, generator=generator)])

    def _finished(self, ids, p, limit) -> dict | None:
        last = ids[-1]
        if not p.get("ignore_eos", False) and last in set(p.get("stop_token_ids") or ()):
            return {"type": "stop", "matched": last}
        if p.get("stop"):
            text = self.tokenizer.decode(ids)
            for s in [p["stop"]] if isinstance(p["stop"], str) else p["stop"]:
                if s in text:
                    return {"type": "stop", "matched": s}
        if len(ids) >= limit:
            return {"type": "length", "length": len(ids)}
        return None

    # -- weights and memory ------------------------------------------------------------------
    def load_tensors(self, named_tensors) -> tuple[bool, str]:
        """SGLang's ``load_weights``: tensors named and laid out as in the checkpoint (per expert
        for MoE models, a tied output layer left out), only the layers they belong to changed."""
        with self.lock:
            if "weights" in self.released:
                raise RuntimeError("weights loaded into released memory")
            named_tensors = list(named_tensors)
            for name, tensor in named_tensors:
                if name not in self.checkpoint:
                    return False, f"Failed to update weights: unknown parameter {name!r}."
                self.checkpoint[name] = tensor.detach().to(torch.float32).clone()
            self._load_layers({layer_of(name) for name, _ in named_tensors})
            self.weights_version += 1
        return True, "Success"

    def _load_layers(self, layers: set[str]) -> None:
        """Copy the checkpoint's tensors of ``layers`` into the model, converted as transformers loads them."""
        params = self.model.state_dict(keep_vars=True)
        if all(name in params for name in self.checkpoint):
            source = self.checkpoint
        else:  # transformers converts this checkpoint as it loads it (fused experts): load it that way
            from safetensors.torch import save_file
            from transformers import AutoModelForCausalLM

            with tempfile.TemporaryDirectory() as folder:
                tensors = {name: t.contiguous() for name, t in self.checkpoint.items()}
                save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
                shutil.copy(Path(self.model_path) / "config.json", folder)
                source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
        with torch.no_grad():
            for name, param in params.items():
                if layer_of(name) in layers and name in source:
                    param.copy_(source[name])

    def load_from_disk(self, model_path) -> tuple[bool, str]:
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            return False, f"Failed to get weights iterator: {model_path} (repository not found)."
        named = [item for f in files for item in load_file(str(f)).items()]
        self.calls.append(("update_weights_from_disk", model_path))
        ok, message = self.load_tensors(named)
        return ok, "Succeeded to update model weights." if ok else message

    def release(self, tags=None):
        with self.lock:
            tags = set(tags or TAGS)
            self.calls.append(("release", sorted(tags)))
            if "weights" in tags and "weights" not in self.released:
                if self.cpu_backup:
                    self.backup = {k: v.clone() for k, v in self.model.state_dict().items()}
                noise = torch.Generator().manual_seed(12345)
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.copy_(torch.randn(p.shape, generator=noise))
            self.released |= tags

    def resume(self, tags=None):
        with self.lock:
            tags = set(tags or TAGS)
            self.calls.append(("resume", sorted(tags)))
            if "weights" in tags & self.released and self.backup is not None:
                self.model.load_state_dict(self.backup)
                self.backup = None
            self.released -= tags


# -- the in-process face: a stand-in ``sglang`` module ---------------------------------------------


class ContractEngine:
    """``sglang.Engine``'s methods and signatures (0.5.x) over :class:`ContractSGLang`."""

    last: ContractEngine | None = None
    fail_start: Exception | None = None

    def __init__(self, **kwargs):
        unknown = set(kwargs) - ENGINE_KEYS
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        if ContractEngine.fail_start is not None:
            raise ContractEngine.fail_start
        self.kwargs = kwargs
        self.core = ContractSGLang(
            kwargs["model_path"],
            seed=kwargs.get("random_seed", 0),
            with_tokenizer=not kwargs["skip_tokenizer_init"],
            cpu_backup=kwargs.get("enable_weights_cpu_backup", False),
        )
        self.core.lora = {k: kwargs[k] for k in LORA_KEYS if k in kwargs}
        self.tensor_calls: list[tuple[list[str], bool]] = []
        self.is_shutdown = False
        self.gc_freezes = 0
        ContractEngine.last = self

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False, lora_path=None, **kw):
        if prompt is not None:
            raise NotImplementedError("the contract engine takes input_ids")
        out = self.core.generate(input_ids, sampling_params, return_logprob, lora_path)
        # in-process outputs hold tuples, as SGLang's do
        return out

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        named_tensors = list(named_tensors)
        self.tensor_calls.append(([n for n, _ in named_tensors], flush_cache))
        self.core.calls.append(("update_weights_from_tensor", len(named_tensors), flush_cache))
        return self.core.load_tensors(named_tensors)

    def update_weights_from_disk(self, model_path, load_format=None):
        ok, message = self.core.load_from_disk(model_path)
        return ok, message, 0

    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        return types.SimpleNamespace(**self.core.load_adapter(lora_name, *read_adapter_folder(lora_path)))

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None):
        return types.SimpleNamespace(**self.core.load_adapter(lora_name, config_dict, dict(tensors)))

    def unload_lora_adapter(self, lora_name):
        return types.SimpleNamespace(**self.core.unload_adapter(lora_name))

    def release_memory_occupation(self, tags=None):
        self.core.release(tags)

    def resume_memory_occupation(self, tags=None):
        self.core.resume(tags)

    def freeze_gc(self):
        # SGLang sends FreezeGCReq to its scheduler and calls gc.freeze() in this process; counted here only,
        # so that the test process's objects stay collectable
        self.gc_freezes += 1

    def shutdown(self):
        self.is_shutdown = True


@pytest.fixture
def sglang_module(monkeypatch):
    """Contract fake of the ``sglang`` package, with a CUDA check that passes (in-process tests)."""
    from hybridrl_rollout_sglang import backends

    module = types.ModuleType("sglang")
    module.Engine = ContractEngine
    module.__version__ = "0.5.17-contract"
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    ContractEngine.last, ContractEngine.fail_start = None, None
    yield module
    ContractEngine.last, ContractEngine.fail_start = None, None


# -- the server face: SGLang's native HTTP API on 127.0.0.1 --------------------------------------------


class ContractServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, core: ContractSGLang):
        super().__init__(("127.0.0.1", 0), ContractHandler)
        self.core = core
        self.fails_left = 0
        self.api_key: str | None = None  # like --api-key: other bearer tokens get 401
        self.pauses = True  # False: no /pause_generation and /continue_generation (before SGLang 0.5)
        self.radix_cache = True  # SGLang's default; False: started with --disable-radix-cache
        self.requests: list[tuple[str, dict | None]] = []  # (path, body) of every call
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def fail_next(self, count: int) -> None:
        """The next ``count`` calls answer 503, as a server that is overloaded or restarting."""
        self.fails_left = count


class ContractHandler(BaseHTTPRequestHandler):
    server: ContractServer

    def log_message(self, *args):
        pass

    def _send(self, status, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n)) if n else None

    def _failing(self):
        key = self.server.api_key
        if key is not None and self.headers.get("Authorization") != f"Bearer {key}":
            self._send(401, {"error": "Unauthorized"})
            return True
        if self.server.fails_left > 0:
            self.server.fails_left -= 1
            self._send(503, {"error": {"message": "Service Unavailable"}})
            return True
        return False

    def do_GET(self):
        self.server.requests.append((self.path, None))
        if self._failing():
            return
        core = self.server.core
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/get_server_info":
            self._send(200, {"model_path": core.model_path, "enable_lora": False, "max_lora_rank": None,
                             "lora_target_modules": None, **core.lora, "version": "0.5.17-contract",
                             "disable_radix_cache": not self.server.radix_cache})  # fmt: skip
        elif self.path == "/get_model_info":
            self._send(
                200,
                {
                    "model_path": core.model_path,
                    "tokenizer_path": core.model_path,
                    "is_generation": True,
                    "preferred_sampling_params": None,
                    "weight_version": "default",
                    "has_image_understanding": False,
                    "has_audio_understanding": False,
                },
            )
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        body = self._body()
        self.server.requests.append((self.path, body))
        if self._failing():
            return
        core = self.server.core
        try:
            if self.path == "/generate":
                if body.get("stream"):
                    raise NotImplementedError("the contract server does not stream")
                keys = ("input_ids", "sampling_params", "return_logprob", "lora_path")
                out = core.generate(*(body.get(k) for k in keys))
                self._send(200, out)
            elif self.path in ("/load_lora_adapter", "/unload_lora_adapter"):
                if self.path == "/load_lora_adapter":
                    result = core.load_adapter(body["lora_name"], *read_adapter_folder(body["lora_path"]))
                else:
                    result = core.unload_adapter(body["lora_name"])
                self._send(200 if result["success"] else 400, result)
            elif self.path in ("/pause_generation", "/continue_generation") and self.server.pauses:
                if self.path == "/pause_generation":
                    core.pause((body or {}).get("mode", "abort"))
                else:
                    core.go_on()
                self._send(200, {"success": True})
            elif self.path == "/update_weights_from_disk":
                ok, message = core.load_from_disk(body["model_path"])
                if ok and body.get("flush_cache", True) and not core.flush_cache():
                    raise AssertionError("Cache flush failed after updating weights")  # the scheduler's end
                self._send(200 if ok else 400, {"success": ok, "message": message, "num_paused_requests": 0})
            elif self.path == "/release_memory_occupation":
                core.release((body or {}).get("tags"))
                self._send(200, None)
            elif self.path == "/resume_memory_occupation":
                core.resume((body or {}).get("tags"))
                self._send(200, None)
            elif self.path == "/flush_cache":
                self._send(200, b"Cache flushed.\n")
            else:
                self._send(404, {"detail": "Not Found"})
        except (ValueError, KeyError, TypeError, NotImplementedError) as e:
            self._send(400, {"error": {"message": str(e)}})


def read_adapter_folder(path) -> tuple[dict, dict]:
    """A peft adapter folder as SGLang's LoRA loader reads it: its config and safetensors."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not (folder / "adapter_config.json").is_file():
        raise ValueError(f"Failed to load LoRA adapter: no adapter_config.json in {path}")
    config = json.loads((folder / "adapter_config.json").read_text())
    return config, load_file(str(folder / "adapter_model.safetensors"))


@pytest.fixture
def sglang_server(tiny_model):
    """Contract fake of an SGLang server (native API) on 127.0.0.1, backed by the tiny model."""
    server = ContractServer(ContractSGLang(tiny_model))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


# -- helpers for the tests -------------------------------------------------------------------------


@pytest.fixture
def make_engine(tiny_model, tmp_path):
    """Build the plugin's engine as the trainer does: ``SGLangEngine(Options(...), RunContext)``."""
    from hybridrl_rollout_sglang import SGLangEngine

    from hybridrl.components import RunContext
    from hybridrl.models import load_tokenizer

    def make(model_path=None, lora=None, **options):
        path = model_path or tiny_model
        ctx = RunContext(
            model_path=path,
            tokenizer=load_tokenizer(path),
            device=torch.device("cpu"),
            dtype=torch.float32,
            seed=0,
            run_dir=tmp_path / "run",
            lora=lora,
        )
        return SGLangEngine(SGLangEngine.Options(**options), ctx)

    return make


@pytest.fixture
def prompts(tiny_model):
    """Three chat prompts of the tiny model, as token ids."""
    from hybridrl.models import load_tokenizer

    tok = load_tokenizer(tiny_model)
    questions = ["What is 3 + 4?", "Say seven.", "Count to 5"]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]  # fmt: skip
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture
def logprob_gap():
    """Max |engine logprob - trainer logprob| over all response tokens, for a model's weights."""
    from hybridrl.batch import Batch
    from hybridrl.passes import response_logprobs

    def gap(model, prompts, out, n, temperature):
        batch = Batch.from_rollout(prompts, out, n, pad_id=0)
        T = batch["responses"].shape[1]
        with torch.no_grad():
            lp, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, T, temperature)
        mask = batch["response_mask"].bool()
        return (lp - batch["rollout_logprobs"]).abs()[mask].max().item()

    return gap
