"""Fault domains beyond racks: power domains from config and from node features (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from ClusterShell.NodeSet import NodeSet, NodeSetParseError

from raps_slurm.errors import PlacementError
from raps_slurm.model import NodeInfo, Topology


def power_domains(nodes: Iterable[NodeInfo], configured: Mapping[str, str],
                  feature_prefix: str) -> dict[str, str]:
    """Node -> power domain. Config (domain -> hostlist) wins over node features.

    A node feature ``<prefix><domain>`` (e.g. ``power_pdu1``) names the domain, so
    admins can keep it in slurm.conf next to the node definition.
    """
    out: dict[str, str] = {}
    if feature_prefix:
        for node in nodes:
            for feat in sorted(node.features):
                if feat.startswith(feature_prefix) and len(feat) > len(feature_prefix):
                    out[node.name] = feat[len(feature_prefix):]
                    break
    for domain, hostlist in sorted(configured.items()):
        try:
            members = NodeSet(hostlist)
        except NodeSetParseError as exc:
            raise PlacementError(
                f"topology.power_domains.{domain}: bad hostlist {hostlist!r}: {exc}") from None
        for name in members:
            out[name] = domain
    return out


def with_power_domains(topology: Topology, nodes: Iterable[NodeInfo],
                       configured: Mapping[str, str], feature_prefix: str) -> Topology:
    """The topology with its power domains filled in."""
    return replace(topology, power_domains=power_domains(nodes, configured, feature_prefix))
