"""Reading a sharded (torch.distributed.checkpoint) checkpoint without running code from it.

torch's reader unpickles ``.metadata`` with ``pickle.load``, and its planner the entries that are
not tensors with ``torch.load(weights_only=False)``: a crafted checkpoint ran its payload on a
resume under torchrun. :func:`load_distributed` reads both through allow-lists instead.
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path

import torch

from hybridrl import distributed
from hybridrl.checkpoint import per_rank
from hybridrl.checkpoint_files import CheckpointError, refused

# What torch.distributed.checkpoint's .metadata is made of (torch 2.13), by module; plus torch's dtypes.
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name (torch.strided)
    "torch": {"Size"},
    "pathlib": {"PosixPath"},  # the checkpoint_id it was saved as
}
TORCH_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class MetadataUnpickler(pickle.Unpickler):
    """Reads a ``.metadata`` file building only what one is made of (``DCP_METADATA_GLOBALS``, torch's
    dtypes): any other class or function a pickle names (``os.system``, a module's code) is refused
    before it can be called. The classes allowed are records whose constructors only store their
    arguments."""

    def find_class(self, module: str, name: str):
        if name in DCP_METADATA_GLOBALS.get(module, ()) or (module == "torch" and name in TORCH_DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of a torch.distributed.checkpoint .metadata file; it is not loaded."
        )


def load_distributed(state: dict, path: Path) -> None:
    """``torch.distributed.checkpoint.load(state, checkpoint_id=path)``, building tensors and plain data
    only. Collective: call it on every rank; a failure on any is a CheckpointError on all.

    torch's reader unpickles ``.metadata`` with ``pickle.load``, and its planner the entries that are
    not tensors (the optimizer's hyperparameters) with ``torch.load(weights_only=False)``: each runs
    whatever code a crafted file names. Here ``.metadata`` goes through :class:`MetadataUnpickler`,
    those entries through ``torch.load(weights_only=True)``, and every file the metadata points at
    must be a plain file of ``path`` (no ``../``). torch 2.13 offers no reader of ``.metadata``
    without pickle; these allow-lists are the boundary, the digests of meta.json a second line.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _dcp_reader_classes()
    try:
        dcp.load(state, storage_reader=reader(path), planner=planner())
    except CheckpointException as e:  # a BaseException, raised on every rank: each rank's error and traceback
        errors = [e.failures.get(r, (None,))[0] for r in range(distributed.world_size())]
        why = per_rank([None if x is None else f"{type(x).__name__}: {' '.join(str(x).split())}" for x in errors])
        raise CheckpointError(f"{path} cannot be loaded: {why}") from e


@functools.cache
def _dcp_reader_classes():
    """torch.distributed.checkpoint's reader and planner with their pickles read safely (defined on
    first use: importing torch.distributed.checkpoint takes half a second)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self) -> Metadata:  # no rank argument: no fall-back to per-rank metadata files
            folder = Path(self.path)
            with open(folder / ".metadata", "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"{folder / '.metadata'} holds a {type(metadata).__name__}, not Metadata.")
            for info in metadata.storage_data.values():
                name = getattr(info, "relative_path", None)
                if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
                    raise ValueError(f"{folder / '.metadata'} points at {name!r}, which is not a file of {folder}.")
            if metadata.storage_meta is None:  # as torch's reader does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:  # torch's, with weights_only=True
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                fqn = read_item.dest_index.fqn
                raise pickle.UnpicklingError(f"its entry {fqn} holds more than plain data: {refused(e)}") from e
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Reader, Planner
