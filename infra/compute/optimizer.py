"""Pick where a cluster runs: every (instance type, region, zone, market) that meets the job's floors, cheapest first.

Floors are applied one after another; when one leaves nothing, planning fails naming that floor and the offer that
came closest to meeting it, so the user knows exactly what to relax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from infra.compute.catalog import Catalog, InstanceType, RegionOffer
from infra.compute.spec import ClusterSpec


class NoCandidateError(ValueError):
    """No offer meets a floor; one line naming the floor, the closest offer that misses it, and the fix."""


@dataclass(frozen=True)
class Offer:
    """One instance type sold in one region on one market, before the floors."""

    instance: InstanceType
    region: str
    offer: RegionOffer
    spot: bool

    @property
    def price(self) -> float | None:
        return self.offer.spot if self.spot else self.offer.on_demand


@dataclass(frozen=True)
class Candidate:
    provider: str
    instance_type: str
    region: str
    zone: str | None  # None: the provider picks a zone in the region
    spot: bool
    nodes: int
    price_per_node_hour: float
    hours: float
    gpus_per_node: int
    network_gbps: float
    network_kind: str
    local_nvme_bytes: int
    efa_interfaces: int
    price_source: str

    @property
    def cluster_per_hour(self) -> float:
        return self.price_per_node_hour * self.nodes

    @property
    def job_cost(self) -> float:
        return self.cluster_per_hour * self.hours

    @property
    def market(self) -> str:
        return "spot" if self.spot else "on-demand"

    @property
    def key(self) -> str:
        """Names this candidate in idempotency tokens and logs: the same candidate always gets the same key."""
        return f"{self.provider}:{self.instance_type}:{self.region}:{self.zone or '-'}:{self.market}"

    def label(self) -> str:
        return f"{self.instance_type} {self.zone or self.region} {self.market}"


@dataclass(frozen=True)
class Floor:
    field: str
    keeps: Callable[[Offer], bool]
    closeness: Callable[[Offer], float]  # higher is closer to meeting the floor
    wanted: str
    shows: Callable[[Offer], str]
    fix: str


def accelerator_matches(wanted: str, instance: InstanceType) -> bool:
    """'H100' matches any H100; 'A100-80GB' (or 'A100:80') also needs 80 GB per GPU."""
    name, _, memory = wanted.replace(":", "-").partition("-")
    if instance.accelerator is None or instance.accelerator.lower() != name.lower():
        return False
    return not memory or instance.gpu_memory_gb >= float(memory.lower().removesuffix("gb"))


def floors(spec: ClusterSpec) -> list[Floor]:
    """The job's floors in the order they are checked; the order decides which one a failure names."""
    def price_per_hour(o: Offer) -> float:
        return (o.price or float("inf")) * spec.nodes

    rows = [
        Floor("cluster.provider", lambda o: o.instance.provider == spec.provider, lambda o: 0.0,
              f"an instance type of provider '{spec.provider}'", lambda o: o.instance.provider,
              "use a provider the catalog lists"),
    ]
    if spec.instance_type:
        rows.append(Floor("cluster.instance_type", lambda o: o.instance.name == spec.instance_type, lambda o: 0.0,
                          f"instance type '{spec.instance_type}'", lambda o: o.instance.name,
                          "use a type the catalog lists or remove cluster.instance_type"))
    if spec.accelerator:
        wanted = spec.accelerator
        rows.append(Floor("cluster.accelerator", lambda o: accelerator_matches(wanted, o.instance),
                          lambda o: float(o.instance.gpus), f"accelerator {wanted}",
                          lambda o: f"{o.instance.accelerator or 'no GPU'} {o.instance.gpu_memory_gb:g}GB",
                          "choose an accelerator the catalog lists"))
    rows += [
        Floor("cluster.procs_per_node", lambda o: o.instance.gpus >= spec.procs_per_node if spec.accelerator else True,
              lambda o: float(o.instance.gpus), f"{spec.procs_per_node} GPUs per node",
              lambda o: f"{o.instance.gpus} GPUs", "lower procs_per_node (one process per GPU)"),
        Floor("cluster.min_network_gbps", lambda o: o.instance.network_gbps >= spec.min_network_gbps,
              lambda o: o.instance.network_gbps, f"{spec.min_network_gbps:g} Gbps",
              lambda o: f"{o.instance.network_gbps:g} Gbps {o.instance.network_kind}", "lower min_network_gbps"),
        Floor("cluster.local_nvme", lambda o: o.instance.local_nvme_bytes > 0 or not spec.local_nvme,
              lambda o: 0.0, "local NVMe", lambda o: "no local NVMe", "set local_nvme: false"),
        Floor("cluster.regions", lambda o: not spec.regions or o.region in spec.regions, lambda o: 0.0,
              "a region in " + ", ".join(spec.regions), lambda o: f"region {o.region}", "add a region it is sold in"),
        Floor("cluster.zones", lambda o: not spec.zones or bool(set(o.offer.zones) & set(spec.zones)), lambda o: 0.0,
              "a zone in " + ", ".join(spec.zones), lambda o: "zones " + ",".join(o.offer.zones) or "no zones",
              "add a zone it is offered in or remove cluster.zones"),
        Floor("cluster.spot", lambda o: o.spot if spec.spot == "only" else (not o.spot or spec.spot == "prefer"),
              lambda o: 0.0, f"the {spec.spot} spot policy", lambda o: "spot" if o.spot else "on-demand",
              "set spot: prefer or never"),
        Floor("cluster.spot", lambda o: o.price is not None, lambda o: 0.0, "a known price on the chosen market",
              lambda o: "no price for " + ("spot" if o.spot else "on-demand"), "set spot: prefer or never"),
        Floor("cluster.max_price_per_hour",
              lambda o: spec.max_price_per_hour is None or price_per_hour(o) <= spec.max_price_per_hour,
              lambda o: -price_per_hour(o), f"at most ${spec.max_price_per_hour}/hour for {spec.nodes} nodes",
              lambda o: f"${price_per_hour(o):.2f}/hour for {spec.nodes} nodes in {o.region}",
              "raise max_price_per_hour, use fewer nodes or allow spot"),
    ]
    return rows


def offers(catalog: Catalog) -> list[Offer]:
    return [Offer(instance, region, offer, spot) for instance in catalog.instances
            for region, offer in instance.regions.items() for spot in (False, True)]


def feasible_offers(spec: ClusterSpec, catalog: Catalog) -> list[Offer]:
    remaining = offers(catalog)
    for floor in floors(spec):
        kept = [o for o in remaining if floor.keeps(o)]
        if not kept:
            closest = max(remaining, key=floor.closeness, default=None)
            near = f"; closest: {closest.instance.name} ({floor.shows(closest)})" if closest else ""
            raise NoCandidateError(f"{floor.field}: no {spec.provider} instance type meets {floor.wanted}{near}: "
                                   f"{floor.fix}")
        remaining = kept
    return remaining


def candidates(spec: ClusterSpec, catalog: Catalog, hours: float) -> list[Candidate]:
    """Every place to try, in the order to try them: spot before on-demand (policy prefer), then cheapest job."""
    out = []
    for offer in feasible_offers(spec, catalog):
        zones = [z for z in offer.offer.zones if not spec.zones or z in spec.zones] or [None]
        for zone in zones:
            out.append(Candidate(
                provider=offer.instance.provider, instance_type=offer.instance.name, region=offer.region, zone=zone,
                spot=offer.spot, nodes=spec.nodes, price_per_node_hour=offer.price or 0.0, hours=hours,
                gpus_per_node=offer.instance.gpus, network_gbps=offer.instance.network_gbps,
                network_kind=offer.instance.network_kind, local_nvme_bytes=offer.instance.local_nvme_bytes,
                efa_interfaces=offer.instance.efa_interfaces, price_source=offer.offer.source,
            ))
    region_rank = {region: i for i, region in enumerate(spec.regions)}
    return sorted(out, key=lambda c: (not c.spot, round(c.job_cost, 6), region_rank.get(c.region, len(region_rank)),
                                      c.region, c.zone or "", c.instance_type))


def render_candidates(found: list[Candidate], limit: int = 12) -> str:
    shown = found[:limit]
    # As wide as the longest name shown: Azure's sizes and Nebius's platform-preset names run past 30 characters.
    width = max([16, *(len(c.instance_type) for c in shown)])
    header = f"  {'#':>2}  {'instance type':<{width}} {'where':<14} {'market':<9} {'$/node-h':>9} {'$/h':>9} " \
             f"{'job ≤':>10}  network"
    lines = [header]
    for i, c in enumerate(shown, 1):
        lines.append(f"  {i:>2}  {c.instance_type:<{width}} {c.zone or c.region:<14} {c.market:<9} "
                     f"{c.price_per_node_hour:>9.2f} {c.cluster_per_hour:>9.2f} {c.job_cost:>10.2f}  "
                     f"{c.network_gbps:g} Gbps {c.network_kind}")
    if len(found) > limit:
        lines.append(f"  … and {len(found) - limit} more")
    return "\n".join(lines)
