"""The cost model: a plan's predicted decode speed and time to first token, from the measured
time of one decoder layer on each machine and the links between them. Pure arithmetic over
measurements (engines/model/speed_probe.py measures them); no clock of its own.

    single: a token costs layers x layer(rows) + head(rows)
    tp:     the slowest rank's layers x shard(rows) + head(rows), plus 2 all_sums a layer
            (a ring's 2(n-1) steps, each carrying 1/n of the rows, at the slowest link's
            step), plus rank 0's step command to the others; for 2 ranks whose group was
            measured as one (the member's link has `tp_layer`), layers x tp_layer(rows) +
            tp_rest(rows) + the step command instead, no less than a held rank's CPU time
            a step over its share
    pp:     one stream pays every stage and every hop; a full pipeline keeps one micro-batch
            per stage in flight, so a cycle is the slowest stage times the micro-batches, or
            one trip around the ring, whichever is longer

Speculation: a pass of a sequence decoding alone that verifies a draft feeds its next token and
the draft, priced as that many rows (the same matmuls; every hop carries each position). How
many tokens a pass yields depends on the prompts, so no plan is predicted with it up front:
`predict_speculating` prices a plan's 1-stream speed at the acceptance its engine measured.

Layer times are sustained ones (a machine busy all the time). A machine held to a share of a
core (a cgroup's CPU quota) runs a short burst at full speed: a pipeline stage idle while the
others work gets its layers done at `cpu_share` of its sustained time, as long as its work
fits its share of the trip (a token's trip is at least every stage's sustained time).

A ring step over a link: where the link's 2-rank all_sum was measured (by rows of hidden
states, engines/tensor_parallel/collective_probe.py), half of it at twice the step's rows,
since a 2-rank ring all_sum is 2 steps each carrying half of them; elsewhere the ping's one-way
latency plus the step's bytes at the pinged rate. The measured rows are a batch's, not a
prefill chunk's, so a measured step is never predicted faster than its bytes at the pinged rate
(which is what a chunk's rows cost); its latency is the measurement's, not the ping's (a ping
crosses the encrypted control channel, an all_sum mlx's ring).

A 2-rank group measured as one (engines/model/tp_step_probe.py: the coordinator and the member
step a sharded model in lockstep; where a rank is held to a CPU quota, only with both ranks'
CPU times, and no faster than a held rank's CPU time over its share) includes what
the sum of its parts misses: on the lab's two
one-core machines an all_sum in the real forward cost ~0.3 ms more than an isolated one (the
ranks drift apart while computing, the lazy graph syncs around each collective), so the parts
predicted ~26 tok/s where tp served 21.4.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from errors import PlanError
from planner.memory import ModelShape

PREDICTION_PROMPT_TOKENS = 512  # the prompt a predicted time to first token is for
PRICED_POSITIONS = 16  # a 1-stream pass is priced feeding 1 to 16 positions; beyond, linearly


@dataclass(frozen=True, slots=True)
class Curve:
    """Seconds as a function of rows, measured at a few row counts; linear between them and
    along the last segment beyond them."""

    points: tuple[tuple[int, float], ...]  # (rows, seconds), rows ascending

    def __post_init__(self) -> None:
        if not self.points:
            raise PlanError("a speed curve needs at least one measured point")
        rows = [row for row, _ in self.points]
        if rows != sorted(set(rows)) or rows[0] < 1:
            raise PlanError(f"a speed curve's rows {rows} must be distinct, ascending and >= 1")
        if any(not (math.isfinite(s) and s > 0) for _, s in self.points):
            raise PlanError(f"a speed curve's times {self.points} must be finite and > 0")

    @classmethod
    def from_json(cls, points: list[list[float]]) -> Curve:
        """A probe's [[rows, seconds], ...]; PlanError when malformed."""
        return cls(tuple((int(rows), float(seconds)) for rows, seconds in points))

    def at(self, rows: float) -> float:
        points = self.points
        if len(points) == 1 or rows <= points[0][0]:
            return points[0][1] * (rows / points[0][0] if rows > points[0][0] else 1.0)
        for (low, low_s), (high, high_s) in zip(points, points[1:], strict=False):
            if rows <= high:
                return low_s + (high_s - low_s) * (rows - low) / (high - low)
        (low, low_s), (high, high_s) = points[-2], points[-1]
        return high_s + max(high_s - low_s, 0.0) / (high - low) * (rows - high)

    def to_dict(self) -> dict[str, float]:
        return {str(rows): seconds for rows, seconds in self.points}


@dataclass(frozen=True, slots=True)
class NodeSpeed:
    """One machine's measured speed for the model being served."""

    node_id: str
    layer: Curve  # one decoder layer's decode step, by rows (sequences decoded together)
    head: Curve  # the final norm and output projection, by rows
    prefill_layer_s: float  # one decoder layer over one prefill chunk
    prefill_chunk: int  # the tokens of that chunk
    shards: tuple[tuple[int, Curve], ...] = ()  # (tp ranks, one layer's 1/ranks shard)
    cpu_share: float = 1.0  # of a core, sustained (a CPU quota): a burst runs 1/share faster

    def __post_init__(self) -> None:
        if not (0 < self.cpu_share <= 1):
            raise PlanError(f"node {self.node_id}'s cpu share {self.cpu_share} must be in (0, 1]")

    def shard(self, ranks: int) -> Curve | None:
        return next((curve for size, curve in self.shards if size == ranks), None)


@dataclass(frozen=True, slots=True)
class RankCpu:
    """One rank's own CPU time in a measured 2-rank tp group, by rows: a layer and the rest of
    a step (its compute, and the ring's threads working while it waits at an all_sum)."""

    layer: Curve
    rest: Curve

    def step_s(self, layers: int, rows: float) -> float:
        return layers * self.layer.at(rows) + self.rest.at(rows)


@dataclass(frozen=True, slots=True)
class LinkSpeed:
    """The link between the coordinator and one member, as measured over the control channel."""

    node_id: str
    latency_s: float  # one way
    bytes_per_s: float
    all_sum: Curve | None = None  # a 2-rank all_sum with the coordinator, by rows, measured
    # one layer (and the rest of a step) of a 2-rank tp group between the coordinator and this
    # member, all_sums included, by rows, measured
    tp_layer: Curve | None = None
    tp_rest: Curve | None = None
    tp_cpu: tuple[RankCpu, RankCpu] | None = None  # the coordinator's and this member's

    def transfer_s(self, size: float) -> float:
        return self.latency_s + size / self.bytes_per_s

    def ring_step_s(self, rows: float, row_bytes: float) -> float:
        """One ring step carrying `rows` hidden states of `row_bytes` (the module docstring)."""
        if self.all_sum is None:
            return self.transfer_s(rows * row_bytes)
        return max(self.all_sum.at(2 * rows) / 2, rows * row_bytes / self.bytes_per_s)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a plan is predicted to do: decode tok/s at 1 stream and at `batch`, and TTFT."""

    strategy: str  # "single", "tp" or "pp"
    nodes: tuple[str, ...]
    decode_tps: float  # one stream
    batch: int
    batch_tps: float  # every stream of a full batch together
    ttft_s: float  # a PREDICTION_PROMPT_TOKENS prompt
    dominant: str  # what most of a token's time goes to, with the numbers
    # a 1-stream token's seconds by the engine's step segments (pp: "stage0".."stageN" and
    # "transit", as engines/pipeline/frame_clock.py names them), to set beside the served ones
    segments: tuple[tuple[str, float], ...] = ()
    # a 1-stream pass's seconds by the positions it feeds (a verifying pass: its next token
    # and the draft); at 1 position, 1 / decode_tps
    pass_s: Curve | None = None

    @property
    def label(self) -> str:
        if self.strategy == "single" and len(self.nodes) > 1:  # alone on an agent, relayed
            return f"single on {self.nodes[-1]}, relayed"
        return self.strategy if self.strategy == "single" else f"{self.strategy}={len(self.nodes)}"

    def describe(self) -> str:
        return (
            f"{self.label} on {', '.join(self.nodes)}: {self.decode_tps:.1f} tok/s at 1 stream, "
            f"{self.batch_tps:.1f} at {self.batch}, TTFT {self.ttft_s * 1000:.0f} ms "
            f"({self.dominant})"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "strategy": self.strategy,
            "label": self.label,
            "nodes": list(self.nodes),
            "decode_tps": round(self.decode_tps, 2),
            "batch": self.batch,
            "batch_tps": round(self.batch_tps, 2),
            "ttft_ms": round(self.ttft_s * 1000, 1),
            "dominant": self.dominant,
            "segments_ms": {name: round(s * 1000, 2) for name, s in self.segments},
        }


@dataclass(frozen=True, slots=True)
class SpeculatingSpeed:
    """A plan's 1-stream decode speed at the speculation its engine measured so far: `passes`
    passes of sequences decoding alone, each fed on average `positions` (its next token and
    the draft) and yielding `tokens`."""

    passes: int
    positions: float
    tokens: float
    decode_tps: float

    def to_dict(self) -> dict[str, float]:
        return {
            "decode_tps": round(self.decode_tps, 2),
            "tokens_per_pass": round(self.tokens, 2),
            "positions_per_pass": round(self.positions, 2),
            "passes": self.passes,
        }


def predict_speculating(
    prediction: Prediction, passes: int, drafted: int, accepted: int
) -> SpeculatingSpeed | None:
    """`prediction`'s 1-stream speed with the engine's speculation counts: over `passes` lone
    passes, `drafted` tokens drafted and `accepted` kept. A pass yields 1 + accepted / passes
    tokens and costs a pass over 1 + drafted / passes positions (the mean pass: the cost is
    linear between the priced positions). None until something was drafted."""
    if prediction.pass_s is None or passes <= 0 or drafted <= 0:
        return None
    positions = 1 + drafted / passes
    tokens = 1 + accepted / passes
    return SpeculatingSpeed(passes, positions, tokens, tokens / prediction.pass_s.at(positions))


def _priced(pass_s: Callable[[float], float]) -> Curve:
    """A 1-stream pass's seconds at every position count up to PRICED_POSITIONS."""
    return Curve(
        tuple((positions, pass_s(positions)) for positions in range(1, PRICED_POSITIONS + 1))
    )


@dataclass(frozen=True, slots=True)
class ClusterSpeeds:
    """Every member's measured speed and link; the coordinator has no link of its own."""

    nodes: Mapping[str, NodeSpeed]
    links: Mapping[str, LinkSpeed]

    def covers(self, node_ids: Sequence[str]) -> bool:
        coordinator = node_ids[0] if node_ids else ""
        return all(
            node in self.nodes and (node == coordinator or node in self.links) for node in node_ids
        )

    def hop(self, source: str, target: str) -> LinkSpeed:
        """The link from `source` to `target`: measured where one end is the coordinator; between
        two members, the slower of their links (a LAN's switch sits between all of them)."""
        ends = [self.links[node] for node in (source, target) if node in self.links]
        if not ends:
            return LinkSpeed(target, 0.0, math.inf)
        return LinkSpeed(
            target,
            max(end.latency_s for end in ends),
            min(end.bytes_per_s for end in ends),
        )


def _chunks(prompt_tokens: int, chunk: int) -> int:
    return max(1, math.ceil(prompt_tokens / chunk))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms" if seconds < 0.01 else f"{seconds * 1000:.1f} ms"


def predict_single(
    shape: ModelShape, speed: NodeSpeed, batch: int, prompt_tokens: int = PREDICTION_PROMPT_TOKENS
) -> Prediction:
    def step(rows: float) -> float:
        return shape.num_layers * speed.layer.at(rows) + speed.head.at(rows)

    prefill = _chunks(prompt_tokens, speed.prefill_chunk) * shape.num_layers
    dominant = f"{shape.num_layers} layers x {_ms(speed.layer.at(1))}"
    return Prediction(
        "single",
        (speed.node_id,),
        1 / step(1),
        batch,
        batch / step(batch),
        prefill * speed.prefill_layer_s + step(1),
        dominant,
        pass_s=_priced(step),
    )


def predict_relay(
    shape: ModelShape,
    speeds: ClusterSpeeds,
    coordinator: str,
    agent: str,
    batch: int,
    prompt_tokens: int = PREDICTION_PROMPT_TOKENS,
) -> Prediction:
    """Single on `agent`, relayed by `coordinator` (planner/relay.py): the agent's step, plus
    each step's hidden states carried to it and its tokens back; one micro-batch."""
    speed, row_bytes = speeds.nodes[agent], shape.hidden_size * shape.dtype_bytes
    there, back = speeds.hop(coordinator, agent), speeds.hop(agent, coordinator)

    def hops_s(rows: float) -> float:
        return there.transfer_s(rows * row_bytes) + back.transfer_s(rows * 8)

    def step(rows: float) -> float:
        return shape.num_layers * speed.layer.at(rows) + speed.head.at(rows) + hops_s(rows)

    chunk = speed.prefill_chunk
    prefill = _chunks(prompt_tokens, chunk) * (
        shape.num_layers * speed.prefill_layer_s + there.transfer_s(chunk * row_bytes)
    )
    dominant = (
        f"{shape.num_layers} layers x {_ms(speed.layer.at(1))} on {agent}; hops {_ms(hops_s(1))}"
    )
    return Prediction(
        "single",
        (coordinator, agent),
        1 / step(1),
        batch,
        batch / step(batch),
        prefill + step(1),
        dominant,
        pass_s=_priced(step),
    )


def all_sum_s(ranks: int, rows: float, row_bytes: float, links: Sequence[LinkSpeed]) -> float:
    """One ring all_sum of `rows` hidden states of `row_bytes` each: 2(ranks-1) steps, each
    carrying 1/ranks of them, at the slowest link's step."""
    if ranks < 2:
        return 0.0
    return 2 * (ranks - 1) * max(link.ring_step_s(rows / ranks, row_bytes) for link in links)


def predict_tp(
    shape: ModelShape,
    speeds: ClusterSpeeds,
    node_ids: Sequence[str],
    batch: int,
    prompt_tokens: int = PREDICTION_PROMPT_TOKENS,
) -> Prediction | None:
    """None when a rank's shard speed was not measured for this many ranks."""
    ranks = len(node_ids)
    curves = [speeds.nodes[node].shard(ranks) for node in node_ids]
    if any(curve is None for curve in curves):
        return None
    links = [speeds.links[node] for node in node_ids[1:]]
    row_bytes = shape.hidden_size * shape.dtype_bytes
    command = max(link.latency_s for link in links)  # rank 0 tells every rank what to run

    def compute(rows: float) -> float:
        return max(
            shape.num_layers * curve.at(rows) + speeds.nodes[node].head.at(rows)
            for node, curve in zip(node_ids, curves, strict=True)
            if curve is not None
        )

    def collectives(rows: float) -> float:
        return 2 * shape.num_layers * all_sum_s(ranks, rows, row_bytes, links)

    # a 2-rank group measured whole, on the member's link: its layer and rest, all_sums
    # included. Under a CPU quota only with each rank's CPU time: the probe's short pairs run
    # as a burst (in the lab they read a 0.4-core rank's group at 26.5 tok/s; it served 8.1),
    # and a rank cannot sustain a step quicker than its CPU time over its share.
    shares = [speeds.nodes[node].cpu_share for node in node_ids]
    cpu = links[0].tp_cpu if ranks == 2 else None
    measured_group = ranks == 2 and (cpu is not None or all(share >= 1 for share in shares))
    layer, rest = (links[0].tp_layer, links[0].tp_rest) if measured_group else (None, None)

    # only held ranks: a free rank's CPU time may exceed the wall time (threads on more cores)
    held = [
        (node, share, rank)
        for node, share, rank in zip(node_ids, shares, cpu or (), strict=False)
        if share < 1
    ]

    def step(rows: float) -> float:
        if layer is None or rest is None:
            return compute(rows) + collectives(rows) + command
        wall = shape.num_layers * layer.at(rows) + rest.at(rows)
        sustained = [rank.step_s(shape.num_layers, rows) / share for _, share, rank in held]
        return max([wall, *sustained]) + command

    slowest = max(speeds.nodes[node].prefill_layer_s for node in node_ids)
    chunk = speeds.nodes[node_ids[0]].prefill_chunk
    shard_share = max(
        curve.at(1) / speeds.nodes[node].layer.at(1)
        for node, curve in zip(node_ids, curves, strict=True)
        if curve is not None
    )
    chunks = _chunks(prompt_tokens, chunk)
    prefill = chunks * (shape.num_layers * slowest * shard_share + collectives(chunk)) + step(1)
    count = 2 * shape.num_layers
    measured = " measured" if all(link.all_sum is not None for link in links) else ""
    dominant = (
        f"compute {_ms(compute(1))}, {count}{measured} all_sum of "
        f"{_ms(all_sum_s(ranks, 1, row_bytes, links))} = {_ms(collectives(1))}"
    )
    if layer is not None and rest is not None:
        dominant = (
            f"{shape.num_layers} layers x {_ms(layer.at(1))} measured as a 2-rank group, "
            f"the rest {_ms(rest.at(1))}"
        )
        dominant += "".join(
            f"; {node} at {share:g} of a core: {_ms(rank.step_s(shape.num_layers, 1))} "
            "of its CPU a step"
            for node, share, rank in held
        )
    return Prediction(
        "tp", tuple(node_ids), 1 / step(1), batch, batch / step(batch), prefill, dominant,
        pass_s=_priced(step),
    )  # fmt: skip


def predict_pp(
    shape: ModelShape,
    speeds: ClusterSpeeds,
    stages: Sequence[tuple[str, int]],
    batch: int,
    prompt_tokens: int = PREDICTION_PROMPT_TOKENS,
) -> Prediction:
    """`stages`: (node id, layer count) in pipeline order, the coordinator first."""
    nodes = [node for node, _ in stages]
    row_bytes = shape.hidden_size * shape.dtype_bytes
    hops = [speeds.hop(node, nodes[(index + 1) % len(nodes)]) for index, node in enumerate(nodes)]

    def stage_s(index: int, rows: float) -> float:
        node, layers = stages[index]
        head = speeds.nodes[node].head.at(rows) if index == len(stages) - 1 else 0.0
        return layers * speeds.nodes[node].layer.at(rows) + head

    def burst_s(index: int, rows: float) -> float:
        return stage_s(index, rows) * speeds.nodes[stages[index][0]].cpu_share

    def hops_s(rows: float) -> float:
        # the last hop carries only sampled tokens back to the coordinator
        carried = [rows * row_bytes] * (len(hops) - 1) + [rows * 8]
        return sum(hop.transfer_s(size) for hop, size in zip(hops, carried, strict=True))

    def trip(rows: float) -> float:
        """Every stage at its burst speed and every hop; no shorter than a stage's sustained
        time, or that stage's CPU quota would run out within the trip."""
        through = sum(burst_s(i, rows) for i in range(len(stages))) + hops_s(rows)
        return max(through, *(stage_s(i, rows) for i in range(len(stages))))

    micro = min(len(stages), batch)
    rows = batch / micro
    slowest = max(range(len(stages)), key=lambda i: stage_s(i, rows))
    cycle = max(micro * stage_s(slowest, rows), trip(rows))
    chunk = speeds.nodes[nodes[0]].prefill_chunk
    prefill = sum(layers * speeds.nodes[node].prefill_layer_s for node, layers in stages) * _chunks(
        prompt_tokens, chunk
    )
    transfers = sum(hop.transfer_s(chunk * row_bytes) for hop in hops[:-1])
    node, layers = stages[slowest]
    dominant = (
        f"slowest stage {node}: {layers} layers x {_ms(speeds.nodes[node].layer.at(rows))} at "
        f"{rows:g} rows; hops {_ms(hops_s(1))}{_shares(speeds, nodes)}"
    )
    # a stage's frame at 1 stream; the trip may be longer still (a held stage's sustained time)
    segments = tuple((f"stage{i}", burst_s(i, 1)) for i in range(len(stages)))
    return Prediction(
        "pp",
        tuple(nodes),
        1 / trip(1),
        batch,
        batch / cycle,
        prefill + transfers + trip(1),
        dominant,
        (*segments, ("transit", hops_s(1))),
        pass_s=_priced(trip),
    )


def _shares(speeds: ClusterSpeeds, nodes: Sequence[str]) -> str:
    """ "; vm-2 at 0.4 of a core" for the nodes held to a CPU quota."""
    shares = {node: speeds.nodes[node].cpu_share for node in nodes}
    held = [f"{node} at {share:.2g} of a core" for node, share in shares.items() if share < 1]
    return f"; {', '.join(held)}" if held else ""


def split_by_speed(
    total_layers: int, layer_costs: Sequence[float], capacities: Sequence[int], last_extra: float
) -> list[int] | None:
    """Layer counts per stage (pipeline order) that make the slowest stage as fast as it can
    be: every stage at least one layer and at most its memory's `capacities`; the last stage
    also pays `last_extra` (the output head). None when the capacities cannot hold the model.

    Greedy is exact here: each stage's time grows linearly with its layers, so giving the next
    layer to the stage that would finish it soonest never raises the maximum needlessly.
    """
    stages = len(layer_costs)
    if stages == 0 or stages > total_layers or any(cap < 1 for cap in capacities):
        return None
    if sum(min(cap, total_layers) for cap in capacities) < total_layers:
        return None
    counts = [1] * stages
    extra = [0.0] * (stages - 1) + [last_extra]
    for _ in range(total_layers - stages):
        open_stages = [i for i in range(stages) if counts[i] < capacities[i]]
        best = min(open_stages, key=lambda i: ((counts[i] + 1) * layer_costs[i] + extra[i], i))
        counts[best] += 1
    return counts
