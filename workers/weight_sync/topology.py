"""Network topology for weight sync: which global rank lives in which datacenter and node,
and how fast each class of link is.

Built once from the config (``Topology.from_config``) and then only read. Ranks not listed
anywhere live in the default datacenter, each on its own node, so the default topology
(``Topology()``) is "everything in one datacenter".

Config form (YAML: a run config's top-level ``topology:`` section)::

    datacenters: {h800: [0, 1, 2, 3], h20: [4, 5]}   # dc name -> global ranks
    default_datacenter: h800                          # optional: one of the above (first)
    nodes: {n0: [0, 1], n1: [2, 3]}                   # optional: ranks sharing a node
    bandwidth_gbps: {intra_node: 1600, intra_dc: 200, inter_dc: 80}
    shaped_links: [inter_dc]                           # emulate these links by pacing
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping


class LinkClass(str, Enum):
    """The class of the link between two ranks (the slowest hop decides)."""

    INTRA_NODE = "intra_node"
    INTRA_DC = "intra_dc"
    INTER_DC = "inter_dc"


DEFAULT_DC = "dc0"
# Bytes per second per link class; defaults follow the paper's cluster (NVLink, 200 Gbps
# RoCE, 80 Gbps dedicated cross-datacenter link).
DEFAULT_BANDWIDTH_GBPS = {"intra_node": 1600.0, "intra_dc": 200.0, "inter_dc": 80.0}
_CONFIG_KEYS = {"datacenters", "nodes", "bandwidth_gbps", "shaped_links", "default_datacenter"}


@dataclass(frozen=True)
class Topology:
    """rank_dc: global rank -> datacenter name (unlisted ranks: ``default_dc``);
    rank_node: global rank -> node name (unlisted ranks: a node of their own);
    bandwidth: link class -> bytes/s; shaped: link classes the executor paces to
    ``bandwidth`` (emulation on loopback; empty on a real cluster)."""

    rank_dc: Mapping[int, str] = field(default_factory=dict)
    rank_node: Mapping[int, str] = field(default_factory=dict)
    bandwidth: Mapping[LinkClass, float] = field(
        default_factory=lambda: {LinkClass(k): v * 1e9 / 8 for k, v in DEFAULT_BANDWIDTH_GBPS.items()})
    shaped: frozenset[LinkClass] = frozenset()
    default_dc: str = DEFAULT_DC

    def check_world(self, world_size: int) -> None:
        """Every listed rank is one of the run's ``world_size`` static ranks (joined processes
        pull their weights over RPC: they are never in a tree); else a ValueError naming the key."""
        for key, groups in (("datacenters", self.rank_dc), ("nodes", self.rank_node)):
            for r, name in sorted(groups.items()):
                if r >= world_size:
                    raise ValueError(f"topology.{key}.{name}: rank {r} is outside the world of {world_size} "
                                     f"ranks (0..{world_size - 1})")

    def __post_init__(self) -> None:
        for lc in LinkClass:
            bw = self.bandwidth.get(lc)
            if bw is None or not 0 < bw < math.inf:
                raise ValueError(f"topology bandwidth for {lc.value!r} must be finite and > 0, got {bw!r}")
        for r in list(self.rank_dc) + list(self.rank_node):
            if not isinstance(r, int) or r < 0:
                raise ValueError(f"topology rank {r!r} must be an int >= 0")

    # ---- queries -------------------------------------------------------------------
    def dc(self, rank: int) -> str:
        return self.rank_dc.get(rank, self.default_dc)

    def node(self, rank: int) -> str:
        return self.rank_node.get(rank, f"{self.dc(rank)}/rank{rank}")

    def link(self, a: int, b: int) -> LinkClass:
        """Class of the link between ranks ``a`` and ``b``."""
        if self.dc(a) != self.dc(b):
            return LinkClass.INTER_DC
        if self.node(a) == self.node(b):
            return LinkClass.INTRA_NODE
        return LinkClass.INTRA_DC

    def bandwidth_between(self, a: int, b: int) -> float:
        """Bytes/s of the link between ``a`` and ``b``."""
        return self.bandwidth[self.link(a, b)]

    def is_shaped(self, a: int, b: int) -> bool:
        return self.link(a, b) in self.shaped

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None) -> "Topology":
        """Build from the ``topology`` config dict (None or {} -> one DC).
        Raises ValueError naming the offending key."""
        if not cfg:
            return cls()
        if not isinstance(cfg, Mapping):
            raise ValueError(f"topology must be a mapping, got {type(cfg).__name__}")
        unknown = sorted(set(cfg) - _CONFIG_KEYS, key=str)
        if unknown:  # (as every section says it)
            from workers.config_schema import near_miss

            raise ValueError(f"topology.{unknown[0]}: unknown key{near_miss(unknown[0], _CONFIG_KEYS)} "
                             f"(known: {sorted(_CONFIG_KEYS)})")
        # only an absent key (or null) is its default: `datacenters: []`, `shaped_links: false`
        # were taken as none, and an emulated cross-DC set-up ran as one DC, unshaped (review, s54)
        dcs = _given(cfg, "datacenters", {})
        rank_dc = _rank_groups(dcs, "topology.datacenters")
        rank_node = _rank_groups(_given(cfg, "nodes", {}), "topology.nodes")
        for name in set(rank_node.values()):
            if _IMPLICIT_NODE.fullmatch(name):
                raise ValueError(f"topology.nodes.{name}: names of the form DC/rankN are the node of a rank listed "
                                 "in no node (its own); name it otherwise")
        names = list(dcs.keys())
        # datacenter names are strings (YAML `{0: [...]}` keys are ints; _rank_groups str()s them)
        default_dc = cfg.get("default_datacenter", str(names[0]) if names else DEFAULT_DC)
        if isinstance(default_dc, int) and not isinstance(default_dc, bool):
            default_dc = str(default_dc)  # as the datacenter keys: YAML `default_datacenter: 1`
        if not isinstance(default_dc, str):
            raise ValueError(f"topology.default_datacenter must be a string (or an int, taken as one), "
                             f"got {default_dc!r}")
        if names and default_dc not in map(str, names):
            # a typo would silently put every unlisted rank in a datacenter of its own
            raise ValueError(f"topology.default_datacenter: {default_dc!r} is none of topology.datacenters "
                             f"{[str(n) for n in names]} (list it there, with [] for no ranks, to use it)")
        for r, node in rank_node.items():
            dcs = {rank_dc.get(o, default_dc) for o, n in rank_node.items() if n == node}
            if len(dcs) > 1:
                raise ValueError(f"topology.nodes.{node}: ranks span datacenters "
                                 f"{sorted(dcs)} (rank {r})")
        bw_cfg = _given(cfg, "bandwidth_gbps", {})
        if not isinstance(bw_cfg, Mapping):
            raise ValueError("topology.bandwidth_gbps must be a mapping")
        bandwidth = {}
        for key in bw_cfg:
            if key not in DEFAULT_BANDWIDTH_GBPS:
                raise ValueError(f"topology.bandwidth_gbps.{key}: unknown link class; "
                                 f"allowed: {sorted(DEFAULT_BANDWIDTH_GBPS)}")
        for key, default in DEFAULT_BANDWIDTH_GBPS.items():
            v = bw_cfg.get(key, default)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < math.inf:
                raise ValueError(f"topology.bandwidth_gbps.{key} must be a finite number > 0, got {v!r}")
            bandwidth[LinkClass(key)] = float(v) * 1e9 / 8
        shaped_cfg = _given(cfg, "shaped_links", [])
        if not isinstance(shaped_cfg, (list, tuple)):
            raise ValueError(f"topology.shaped_links must be a list of link classes, got {shaped_cfg!r}")
        shaped = set()
        for s in shaped_cfg:
            try:
                shaped.add(LinkClass(s))
            except ValueError:
                raise ValueError(f"topology.shaped_links: unknown link class {s!r}; "
                                 f"allowed: {[lc.value for lc in LinkClass]}") from None
        return cls(rank_dc=rank_dc, rank_node=rank_node, bandwidth=bandwidth,
                   shaped=frozenset(shaped), default_dc=default_dc)


    def to_config(self) -> dict[str, Any]:
        """The ``topology`` section ``from_config`` builds this from (what a run records: sorted,
        so every process writes it alike)."""
        dcs: dict[str, list[int]] = {}
        if self.rank_dc:
            dcs[self.default_dc] = []  # the default named among them, as from_config wants
        for key, groups in (("datacenters", dcs), ("nodes", nodes := {})):
            for r, name in sorted((self.rank_dc if key == "datacenters" else self.rank_node).items()):
                groups.setdefault(name, []).append(r)
        return {"datacenters": dcs, "nodes": nodes,
                "bandwidth_gbps": {lc.value: self.bandwidth[lc] * 8 / 1e9 for lc in LinkClass},
                "shaped_links": sorted(lc.value for lc in self.shaped), "default_datacenter": self.default_dc}


def _given(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    v = cfg.get(key)
    return default if v is None else v


_IMPLICIT_NODE = re.compile(r".*/rank\d+")  # Topology.node of a rank in no named node


def _rank_groups(groups: Any, where: str) -> dict[int, str]:
    """{name: [ranks]} -> {rank: name}; each rank in at most one group, each name once (names
    are strings: YAML's `0:` and `"0":` are one group, refused rather than merged)."""
    if not isinstance(groups, Mapping):
        raise ValueError(f"{where} must be a mapping name -> list of ranks, got {type(groups).__name__}")
    out: dict[int, str] = {}
    seen: dict[str, Any] = {}
    for name, ranks in groups.items():
        if str(name) in seen:
            raise ValueError(f"{where}: {seen[str(name)]!r} and {name!r} are one name ({str(name)!r}); "
                             "name each group once")
        seen[str(name)] = name
        if not isinstance(ranks, (list, tuple)):
            raise ValueError(f"{where}.{name} must be a list of ranks, got {ranks!r}")
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise ValueError(f"{where}.{name}: rank {r!r} must be an int >= 0")
            if r in out:
                raise ValueError(f"{where}: rank {r} listed in both {out[r]!r} and {name!r}")
            out[r] = str(name)
    return out
