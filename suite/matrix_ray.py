"""``fp8rl matrix --ray [ADDRESS]``: each cell of a version matrix as a Ray task.

A cell is :func:`fp8rl.matrix.run_cell` (build the cell's venv with uv, run ``fp8rl conformance`` in it, read its
reports), submitted with the cell's resources (``num_cpus``, ``memory``, ``num_gpus`` for CUDA engines). The cell's
environment is *not* a Ray ``runtime_env``: Ray's ``py_executable`` (Ray 2.60's ``RuntimeEnv(py_executable=...)``)
would start the Ray worker itself with the cell's interpreter, which then needs ``ray`` installed at the driver's
exact version, and the cell's lock is an upstream tier's lock without it. The task runs in the driver's
environment instead and starts the cell venv's ``fp8rl`` as a subprocess; ``runtime_env`` carries the cell's
environment variables only. Every node needs ``uv`` and the fp8rl checkout at the same path (a shared filesystem or
the same clone), since the cell installs it editable; results come back as :class:`~fp8rl.matrix.CellResult`
objects, with the report paths on the node that ran the cell (``host``).

Ray is the optional extra ``ray`` (its lock, ``locks/ray.txt``: the base lock plus ray).
"""

from __future__ import annotations

from collections.abc import Callable

from fp8rl.matrix import CellResult, CellSpec, run_cell


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster can't be reached."""


def ray_executor(address: str | None, *, num_cpus: float = 2.0, memory_gb: float = 4.0, num_gpus: float = 0.0,
                 init_kwargs: dict | None = None) -> Callable[[list[CellSpec]], list[CellResult]]:
    """A function that runs a round of cells as Ray tasks and returns their results (in the order given).
    ``address``: a cluster's (``ray://...`` or ``HOST:PORT``); None starts (or joins) a local instance with
    ``init_kwargs`` (e.g. ``num_cpus=2``)."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable("ray is not installed: pip install 'fp8rl[ray]' (or -r locks/ray.txt)") from None
    if num_cpus <= 0 or memory_gb <= 0 or num_gpus < 0:
        raise RayUnavailable(f"--cell-cpus/--cell-memory-gb/--cell-gpus: expected > 0, > 0, >= 0; got {num_cpus}, "
                             f"{memory_gb}, {num_gpus}")
    if not ray.is_initialized():
        try:
            ray.init(address=address, **(init_kwargs or {}))
        except Exception as exc:  # ConnectionError and Ray's own errors alike
            raise RayUnavailable(f"can't start or join Ray at {address or 'a local instance'}: {exc}") from None

    remote = ray.remote(run_cell)

    def execute(specs: list[CellSpec]) -> list[CellResult]:
        refs = [remote.options(num_cpus=num_cpus, memory=int(memory_gb * 2**30), num_gpus=num_gpus,
                               runtime_env={"env_vars": dict(s.env)} if s.env else None,
                               name=f"fp8rl-matrix-cell-{s.version}").remote(s) for s in specs]
        out = []
        for spec, ref in zip(specs, refs):
            try:
                out.append(ray.get(ref))
            except Exception as exc:  # the task itself died (node lost, worker killed): the cell crashed
                out.append(CellResult(spec.index, spec.version, "crashed", f"ray task failed: {exc}"))
        return out

    return execute


__all__ = ["RayUnavailable", "ray_executor"]
