"""The planner's inputs: a cluster file (datacenters, GPUs, prices, links) and a model spec.

Cluster file (YAML): ``datacenters`` (each ``name``, ``gpu`` (H800/H20/H100/H200/A100),
``gpus``, ``price_per_gpu_hour``, optional ``role``: generation | trainer | any), optional
``link_gbps`` (between datacenters), ``intra_gbps`` (weight-sync bandwidth inside one,
default 1600 = 8 x 200 Gbit/s per node), ``trainer_unit`` and ``gen_unit`` (GPU
granularity of each stage, default 8: a node; the paper scales the SGS by nodes),
``gpus_per_node`` (8: the largest tensor-parallel size) and ``gen_tp`` (GPUs per generation
instance; default: searched, each power of two from the smallest that holds the weights up
to a node, keeping the one of the shortest Algorithm 1 iteration). One datacenter:
Algorithm 1 single-DC over its GPUs. Two with roles: cross-DC. Model specs: ``load_model``.
The planning itself is ``controller.planner.planner``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from controller.planner.hardware import GPUS, MODELS, ModelSpec, check_number, gpu


ROLES = ("any", "generation", "trainer")
MAX_GPUS = 65536  # per datacenter: the search runs every instance count (2,048 H800 for 72B take minutes)


@dataclass
class Datacenter:
    name: str
    gpu: str
    gpus: int
    price_per_gpu_hour: float
    role: str = "any"

    def __post_init__(self):
        where = f"datacenter {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"datacenter name must be a non-empty string, got {self.name!r}")
        try:
            gpu(self.gpu)
        except (ValueError, TypeError):
            raise ValueError(f"{where}: gpu: unknown GPU {self.gpu!r}; known: {sorted(GPUS)}") from None
        self.gpus = check_number(f"{where}: gpus", self.gpus, integer=True)
        if self.gpus > MAX_GPUS:
            raise ValueError(f"{where}: gpus {self.gpus} is more than the planner searches ({MAX_GPUS})")
        self.price_per_gpu_hour = check_number(f"{where}: price_per_gpu_hour", self.price_per_gpu_hour, strict=False)
        if self.role not in ROLES:
            raise ValueError(f"{where}: role {self.role!r} is not generation | trainer | any")


@dataclass
class Cluster:
    name: str
    datacenters: list[Datacenter]
    link_gbps: float = 80.0
    intra_gbps: float = 1600.0
    trainer_unit: int = 8
    gen_unit: int = 8
    gpus_per_node: int = 8
    gen_tp: int | None = None  # None: the planner searches it

    def __post_init__(self):
        where = f"cluster {self.name!r}"
        if not 1 <= len(self.datacenters) <= 2:
            raise ValueError(f"{where}: 1 or 2 datacenters supported, got {len(self.datacenters)}")
        names = [d.name for d in self.datacenters]
        if len(set(names)) < len(names):
            raise ValueError(f"{where}: two datacenters named {names[0]!r}; each needs its own name")
        self.link_gbps = check_number(f"{where}: link_gbps", self.link_gbps)
        self.intra_gbps = check_number(f"{where}: intra_gbps", self.intra_gbps)
        self.trainer_unit = check_number(f"{where}: trainer_unit", self.trainer_unit, integer=True)
        self.gen_unit = check_number(f"{where}: gen_unit", self.gen_unit, integer=True)
        self.gpus_per_node = check_number(f"{where}: gpus_per_node", self.gpus_per_node, integer=True)
        if self.gen_tp is not None:
            self.gen_tp = check_number(f"{where}: gen_tp", self.gen_tp, integer=True)
            if self.gen_tp & (self.gen_tp - 1):
                raise ValueError(f"{where}: gen_tp must be a power of two (1, 2, 4, 8, ...), got {self.gen_tp}")
            if self.gen_tp > self.gpus_per_node:
                raise ValueError(f"{where}: gen_tp {self.gen_tp} is more than one node's GPUs (gpus_per_node "
                                 f"{self.gpus_per_node}); tensor parallelism across nodes is not modelled")
        roles = sorted(d.role for d in self.datacenters)
        if len(roles) == 2 and roles != ["generation", "trainer"]:
            raise ValueError(f"{where}: two datacenters need the roles 'generation' and 'trainer' "
                             f"(one each), got {[d.role for d in self.datacenters]}")
        if len(roles) == 1 and roles != ["any"]:
            raise ValueError(f"{where}: one datacenter runs both stages: its role must be 'any' "
                             f"(or left out), got {roles[0]!r}")

    @property
    def cross_dc(self) -> bool:
        return len(self.datacenters) == 2

    def dc(self, role: str) -> Datacenter:
        if not self.cross_dc:
            return self.datacenters[0]
        return next(d for d in self.datacenters if d.role == role)


CLUSTER_KEYS = ("name", "datacenters", "link_gbps", "intra_gbps", "trainer_unit", "gen_unit", "gpus_per_node",
                "gen_tp")
DATACENTER_KEYS = ("name", "gpu", "gpus", "price_per_gpu_hour", "role")


def _read(path: str | Path, what: str, parse) -> object:
    """``parse(text)`` of file ``path``; a missing, unreadable or malformed file is a
    ValueError naming it."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: {'not a file' if p.exists() else 'no such file'} (expected a {what} file)")
    try:
        return parse(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        msg = " ".join(str(e).split())
        raise ValueError(f"{p}: not a readable {what} file ({msg})") from None


def load_cluster(path: str | Path) -> Cluster:
    """A planner cluster file (module docstring); every problem is a ValueError naming the
    file and the key."""
    d = _read(path, "cluster", yaml.safe_load)
    if isinstance(d, dict) and "placement" in d:
        raise ValueError(f"{path}: this is a runtime config (it has 'placement'), not a planner cluster file "
                         "(see configs/plan_cluster_*.yaml)")
    if not isinstance(d, dict) or "datacenters" not in d:
        raise ValueError(f"{path}: a cluster file needs a 'datacenters' list")
    unknown = set(d) - set(CLUSTER_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(map(str, unknown))}; expected {list(CLUSTER_KEYS)}")
    if not isinstance(d["datacenters"], list) or not all(isinstance(x, dict) for x in d["datacenters"]):
        raise ValueError(f"{path}: datacenters must be a list of mappings ({{name, gpu, gpus, "
                         f"price_per_gpu_hour, role}}), got {d['datacenters']!r}")
    dcs = []
    for i, x in enumerate(d["datacenters"]):
        unknown = set(x) - set(DATACENTER_KEYS)
        missing = set(DATACENTER_KEYS[:4]) - set(x)
        if unknown or missing:
            raise ValueError(f"{path}: datacenters[{i}]: " + "; ".join(
                ([f"unknown keys {sorted(map(str, unknown))}"] if unknown else [])
                + ([f"missing keys {sorted(missing)}"] if missing else [])) + f" (keys: {list(DATACENTER_KEYS)})")
        try:
            dcs.append(Datacenter(**x))
        except ValueError as e:
            raise ValueError(f"{path}: datacenters[{i}]: {e}") from None
    kw = {k: d[k] for k in CLUSTER_KEYS[2:] if k in d}
    name = d.get("name", Path(path).stem)
    try:
        return Cluster(str(name), dcs, **kw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def load_model(spec: str) -> ModelSpec:
    """A built-in name (qwen2.5-7b ... qwen2.5-72b), a YAML file of ModelSpec fields, or an
    HF config.json."""
    if spec in MODELS:
        return MODELS[spec]
    p = Path(spec)
    if not p.exists():
        raise ValueError(f"model {spec!r}: neither a file nor one of {sorted(MODELS)}")
    d = _read(p, "model", json.loads if p.suffix == ".json" else yaml.safe_load)
    # an HF config without a name is named by its folder (models/<name>/config.json), else its file
    name = p.resolve().parent.name if p.name == "config.json" else p.stem
    return ModelSpec.from_dict(d, where=str(p), name=name or "hf-model")
