"""Devices: one resolver for every device option of the project, and errors that name the device.

``resolve_device`` turns a device option (``trainer.device``, ``sharding.ref_device``, a reward's
``device``) into a ``torch.device`` with the same rules everywhere: ``auto`` is a given default
(a reward's: the policy's device) or the rank's GPU when torch sees one, else the CPU; under
torchrun ``cuda`` is ``cuda:LOCAL_RANK`` (the rank's own GPU) and an explicit index means that
index on every node. ``device_errors`` turns torch's "Expected all tensors to be on the same
device" into an error naming the component and where each of its parts was placed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch

from hybridrl.distributed import env_world


class DeviceError(RuntimeError):
    """Tensors met on different devices; the message names the component and the devices."""


def resolve_device(
    name: str,
    key: str = "trainer.device",
    *,
    auto: torch.device | None = None,
    per_rank: bool = False,
    fix: str | None = None,
) -> torch.device:
    """The device for the option ``key`` set to ``name`` on this process.

    :param auto: what ``auto`` means; default the rank's GPU when torch sees one, else the CPU.
    :param per_rank: the option places the policy, one GPU per rank: under torchrun an explicit
        index would put every rank on the same GPU, so it is an error (``trainer.device``).
    :param fix: what the errors suggest; default ``{key}=cpu``.
    """
    _, world, local = env_world()
    fix = fix or f"Use {key}=cpu"
    if name == "auto":
        if auto is not None:
            return torch.device(auto)
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{key} is '{name}', which is not a device name. Use auto, cpu, cuda, cuda:1, ...") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{key} is '{name}', but torch sees no CUDA device (torch {torch.__version__}). {fix}.")
        if device.index is None:
            device = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
        elif world > 1 and per_rank:
            raise ValueError(
                f"{key} is '{name}', but under torchrun each of the {world} ranks takes its own GPU "
                f"(cuda:LOCAL_RANK). Set {key}=cuda, and choose GPUs with CUDA_VISIBLE_DEVICES."
            )
        if device.index >= count:
            have = ", ".join(f"cuda:{i}" for i in range(count))
            raise ValueError(
                f"{key} is '{device}', which does not exist: torch sees {have}"
                + (f" (LOCAL_RANK={local}: run at most {count} processes per node)." if world > 1 else f". {fix}.")
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{key} is 'mps', which torch {torch.__version__} cannot use here. {fix}.")
    return device


_DEVICE_ERROR = re.compile(
    r"Expected all tensors to be on the same device|is not on the expected device|"
    r"Expected .* to be on .* device|must be on the same device|device mismatch",
    re.IGNORECASE,
)
_DEVICE_NAME = re.compile(r"\b(cpu|meta|mps|xpu|cuda(?::\d+)?)\b")


def is_device_error(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and bool(_DEVICE_ERROR.search(str(error)))


@contextlib.contextmanager
def device_errors(component: str, placement: dict | Callable[[], dict], fix: str = "") -> Iterator[None]:
    """Turn torch's "Expected all tensors to be on the same device" inside the block into a
    :class:`DeviceError` naming the component, the devices torch found, and where each part
    was placed (``placement``: label -> device, e.g. ``{"its parameters": "cuda:1", "its inputs":
    "cuda:0"}``, or a function returning it, called only on an error)."""
    try:
        yield
    except RuntimeError as e:
        if not is_device_error(e) or isinstance(e, DeviceError):
            raise
        if callable(placement):
            placement = placement()
        found = sorted(set(_DEVICE_NAME.findall(str(e))))
        where = ", ".join(f"{label} on {dev}" for label, dev in placement.items() if dev is not None)
        raise DeviceError(
            f"{component}: tensors on different devices ({' and '.join(found) or 'see below'}); {where}. {fix}".rstrip()
            + f" [torch: {str(e).splitlines()[0]}]"
        ) from e


def model_device_errors(component: str, model: torch.nn.Module, inputs: torch.device, policy: torch.device):
    """:func:`device_errors` for a forward pass of one of the run's models."""

    def placement():
        devices = sorted({str(p.device) for p in model.parameters()})
        return {"its parameters": ", ".join(devices), "its inputs": inputs, "the policy": policy}

    return device_errors(
        component,
        placement,
        "State each component's device: trainer.device (policy), sharding.ref_device (reference model), "
        "and each reward model's own device option.",
    )
