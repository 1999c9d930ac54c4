"""Pages of memory-mapped checkpoint files: a tensor read straight from its shard (safetensors maps the file) puts
every page it touches in the process's resident memory for as long as the mapping lives. Where a loop reads such a
tensor once, slice by slice, the slices it has read can leave again: they stay in the page cache, and a later touch
maps them back from there. Only mappings of files whose pages were never written qualify: anonymous memory given
back this way would read as zeros, and a written page would read as the file's bytes again."""

from __future__ import annotations

import mmap

import torch

from ..cpu import glibc

_MADV_DONTNEED = 4  # Linux: drop the range's pages from this process (a file mapping's are read again on touch)


def unwritten_file_mapping(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The address range of the one mapping of a file that holds all of the tensor's bytes, where this process has
    written none of its pages (/proc/self/smaps, Linux); else None. safetensors maps shards private and writable: a
    page written there would be a private copy, and dropping it would bring the file's bytes back, so a mapping with
    any such page does not qualify."""
    if tensor.device.type != "cpu" or not tensor.numel():
        return None
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    found = None
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line
                    if found is not None:
                        return None  # its block ended without an Anonymous line
                    low, high = (int(value, 16) for value in fields[0].split("-"))
                    if low <= start < high:
                        path = fields[5].strip() if len(fields) == 6 else ""
                        if end > high or fields[1][0] != "r" or not path.startswith("/"):
                            return None
                        found = (low, high)
                elif found is not None and fields[0] == "Anonymous:":
                    return found if int(fields[1]) == 0 else None
    except (OSError, ValueError, IndexError):
        return None
    return None


def drop_read_pages(tensor: torch.Tensor) -> None:
    """Hand back the whole pages under a contiguous slice of a tensor that unwritten_file_mapping found in a file
    mapping. Nothing happens without glibc's madvise."""
    libc = glibc()
    if libc is None or not hasattr(libc, "madvise") or not tensor.is_contiguous():
        return
    import ctypes

    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page  # whole pages inside the slice only: neighbours keep theirs
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
