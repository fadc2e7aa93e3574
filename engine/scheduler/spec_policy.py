"""The "never slower" rule: how many draft positions each decode gets, from what speculation measurably costs and
what it measurably gains.

From five decoding requests, whether the batch drafts is judged by measured steps (batch_verdict: the whole batch at
the full depth or plainly, by what a probe measured); the model below decides the smaller batches, and a large one
until its first probe.

Cost, fitted online from every pure decode step (a step with a prefill chunk says nothing about the depth), by
exponentially weighted least squares:

    verify(T)      = a + b·T                  the step's cost outside the proposer, T = tokens in the step's forward
    draft(d, B, K) = c0 + d·(c + e·B) + f·K   the proposer's time for depth d over B drafted requests (d >= 1) that
                                              first read K tokens they had not seen (the catch-up)

The draft's ``c0`` is what a drafting step costs whatever its depth (the call, the Python around it): a native draft
chain's whole depth costs about as much as its first token (0.65 ms a step in the executor at one stream, of which ~0.05
ms per depth), and without ``c0`` the fit spread that over the depths, so a draft of 1 looked four times cheaper than
one of 4 and the rule drafted shallow where the full depth paid. The catch-up ``K`` is what a draft model reads before
drafting: a token or so per request while it drafts every step, everything since its last draft after plain steps (its
prompt too, the first time). At 32 streams an exploring step's four requests read 14-35 tokens each (3-5 ms of the
draft's time, against 0.5 at steady state): without ``K`` in the fit that went into ``c0`` and ``e``, by however long
the gap since the last exploration was. The rule plans with the steady catch-up, one token per drafting request, plus
what a request whose draft is behind must read first, spread over the steps it has left (``_switch_share``). ``K`` is
counted by the rule itself from each request's length as the scheduler planned it (``RequestSpec.length``, ``fed``).

A step's cost is its period (the wall time between two commits the loop ran back to back: the host's work on the
step's tokens included) or, when unknown, the executor's time (``StepTiming``): where the scheduler's core is the
bottleneck the executor's time alone made drafting look free.

Gain, per request and draft position k (the k-th token of a chain): the probability ``α_k`` that its k-th draft
token is accepted once the k - 1 before it were, from its own verifies (each verify that reached position k is a
trial there, an accepted k-th token a success; decayed), with the engine-wide rate at that position as a prior of two
trials, itself leaning on an even prior. Per position, because drafts are accepted in runs, not coin by coin: once a
draft model has the text (a list it copies, a phrase it knows) it keeps it, so a later position is accepted more
often than the first (the embedded draft at one stream: α_1 about 0.5, α_2..4 0.7-0.9). One rate for every position
(the geometric model this rule began with) undervalued deep drafts, and worse, a request held at depth 1 measured
only its first position's rate, so a poor first token kept it there (the repeating prompts at one stream: 1.37x plain
against 1.69x at the full depth). The records decay with every step, drafted or not: a rate that rules depth 0 gets no
verify to correct it, so without decay in time one poor start (a prompt whose first drafts fail) would turn
speculation off for good; instead it drifts back to the prior (half-life about 23 steps) and is tried again. A chain
of depth d then yields ``E(d) = 1 + α_1 + α_1·α_2 + ... + α_1···α_d`` tokens per step. A draft model ends a draft
after a token it is unsure of (``--speculative-draft-min-prob``), so each request also keeps, per position k, how often
a draft planned that deep went on to its k-th token (κ_k, κ_1 = 1; the engine-wide rate its prior, leaning on 1): a
draft planned d deep gives ``1 + κ_1·α_1 + κ_1·α_1·κ_2·α_2 + ...`` tokens from ``1 + κ_1 + κ_1·κ_2 + ...`` verify
rows, and its draft runs as many forwards as its longest draft. Taken at the planned depth instead, both were
overcounted where the α measured on the drafted (the sure) positions does not hold for the rest.

Each step the scheduler plans the depth d (0 .. the configured maximum) that maximises the step's tokens per
second, ``Σ E_r(d) / (verify(B + rows) + draft(d, B_s))`` over its B decodes (B_s of them drafting). Depth 0 is
plain decoding, so the rule picks speculation only where the measured model says it is faster; and a narrow win
(under ``sure_margin`` times plain's rate) must also hold with the verify at its upper estimate, ``confidence``
standard errors of the fit's prediction above it: a drafting step's size often lies far beyond the plain steps the
fit mostly saw (at 32 streams, 60-160 tokens against 28-32), and a slope fitted on steps of nearly one size on a
loaded host is mostly noise, which extrapolated low had the rule draft at 27 streams where drafting lost (a bench cell
at 0.86x plain). A wide win is taken as modelled: where drafting has not been measured for a while the upper estimate
is wide too. To keep the
model honest it plans the opposite choice now and then: while drafting, a plain step once every ``explore_every``
steps, the gap doubling (up to ``max_plain_gap``) while drafting wins by ``wide_margin`` or more (a plain probe
costs a step's worth of drafted tokens, and where the margin is wide a somewhat stale fit cannot flip the choice;
at one stream with the native draft chain the fixed period cost about 4% of the throughput); while decoding
plainly, the full depth after a gap that starts at ``explore_every`` and doubles (up to ``max_explore_every``) each
time plain decoding still wins, and with only ``explore_requests`` of the batch drafting (those whose drafts have the
least to catch up on), since a drafting step over a large batch costs several plain ones (depth 1 every other time
while all drafts seen had one depth: the fit cannot tell a draft's call from its depths until it has seen two). Until
the cost model has seen two different step sizes it alternates the full depth and none.

A young request's acceptance rests on its first few verifies, and a request decoding plainly gets no verify that
would correct it: two or three failed first tokens in a row (common where α_1 is 0.35-0.45, as for the embedded draft
on the bench's repeating prompts) put a request below break-even for the rest of its length. So the depth is chosen
with each α optimistic by ``optimism`` standard errors of its estimate, √(α(1 - α) / (its trials + prior + 1)), which
shrinks as the request's own verifies add up, divided by B² over B drafting requests: at one stream a step that drafts
in vain costs a share of one step and the request is the whole gain, while in a batch a whole-batch draft on an
optimistic estimate is the very loss "never slower" guards against (with 1 / B instead, a noisy 32-stream case drafted
the whole batch once in 340 steps). The margin that thins the plain probes is the estimate's own. Half a standard
error: one stream replayed offline on the bench's repeating prompts went from plain decoding in a quarter of its
steps to 6%; a poor draft (α 0.1) costs a lone stream 3.4% of plain's rate against 2.3% without (a whole standard
error: 5.7%).

A request whose first position's acceptance falls below ``min_alpha`` stops drafting for ``pause`` steps (doubled on
each relapse up to ``max_pause``), then tries again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import SpeculativeConfig
from engine.scheduler.batch_verdict import BatchVerdict, PlannedBatch, Verdict, VerdictConfig


@dataclass(frozen=True)
class SpecPolicyConfig:
    explore_every: int = 16
    max_explore_every: int = 256
    wide_margin: float = 1.3  # drafting's modelled tokens/s over plain's at which plain probes thin out
    max_plain_gap: int = 64  # the longest gap between plain probes while drafting (the fit still sees small steps)
    explore_requests: int = 4  # how many of a step's requests draft when it explores drafting (the most caught up)
    switch_horizon: float = 64.0  # at most this many steps a request's catch-up is spread over (see _best_depth)
    forgetting: float = 0.97  # weight kept by past observations per new one (cost fits and acceptances)
    prior_tokens: float = 2.0  # strength of the engine-wide acceptance as a request's prior
    optimism: float = 0.5  # standard errors added to a lone request's acceptance when choosing (see _best_depth)
    confidence: float = 2.0  # standard errors added to a drafting step's modelled verify cost (a narrow win's check)
    sure_margin: float = 1.3  # drafting's modelled rate over plain's from which it is taken without that check
    min_alpha: float = 0.1
    pause: int = 8
    max_pause: int = 256
    verdict: VerdictConfig = field(default_factory=VerdictConfig)  # a large batch: whether it drafts, as measured


class _LinearFit:
    """y ≈ w·x for a few features, by exponentially weighted least squares (normal equations, solved in place), and
    how far a prediction may be off: the residuals' spread carried to a point through the fit's covariance."""

    def __init__(self, forgetting: float, features: int = 2) -> None:
        self._lam = forgetting
        self._xx = [[0.0] * features for _ in range(features)]  # Σ x_i·x_j
        self._xy = [0.0] * features  # Σ x_i·y
        self._yy = 0.0  # Σ y²
        self._weight = 0.0  # Σ of the observations' weights
        self.count = 0

    def add(self, x: Sequence[float], y: float) -> None:
        lam = self._lam
        for i, xi in enumerate(x):
            row = self._xx[i]
            for j, xj in enumerate(x):
                row[j] = lam * row[j] + xi * xj
            self._xy[i] = lam * self._xy[i] + xi * y
        self._yy = lam * self._yy + y * y
        self._weight = lam * self._weight + 1.0
        self.count += 1

    def weights(self, use: Sequence[int] | None = None) -> list[float] | None:
        """The fitted weights with only the features ``use`` (default all; the others' weights 0), or None while
        those features do not yet tell their weights apart (a determinant below 1e-9 of the diagonal's product)."""
        index = list(range(len(self._xy))) if use is None else list(use)
        solved = self._solve(index, [self._xy[i] for i in index])
        if solved is None:
            return None
        out = [0.0] * len(self._xy)
        for i, w in zip(index, solved, strict=True):
            out[i] = w
        return out

    def spreads(self, points: Sequence[Sequence[float]]) -> list[float]:
        """The standard error of the fit's prediction at each of ``points`` (all features): the residuals' weighted
        variance times x·(XᵀWX)⁻¹·x. Small where the observations were, growing with the distance from them; infinite
        while there are too few observations to tell (no more than features: a line through two points has no
        residual)."""
        index = list(range(len(self._xy)))
        weights, dof = self.weights(), self._weight - len(index)
        if weights is None or dof <= 0.0:
            return [math.inf] * len(points)
        variance = max(self._yy - sum(w * xy for w, xy in zip(weights, self._xy, strict=True)), 0.0) / dof
        out = []
        for x in points:
            z = self._solve(index, list(x))
            leverage = sum(xi * zi for xi, zi in zip(x, z, strict=True)) if z is not None else math.inf
            out.append(math.sqrt(variance * max(leverage, 0.0)))
        return out

    def _solve(self, index: list[int], rhs: list[float]) -> list[float] | None:
        """The normal equations' matrix over ``index`` solved for ``rhs``; None when it is (nearly) singular."""
        a = [[self._xx[i][j] for j in index] + [r] for i, r in zip(index, rhs, strict=True)]  # augmented
        bound = 1.0
        for i in range(len(index)):
            bound *= a[i][i]
        det = 1.0
        for col in range(len(index)):  # Gaussian elimination with partial pivoting
            pivot = max(range(col, len(index)), key=lambda r: abs(a[r][col]))
            if pivot != col:
                a[col], a[pivot], det = a[pivot], a[col], -det
            det *= a[col][col]
            if a[col][col] == 0.0:
                return None
            for r in range(col + 1, len(index)):
                f = a[r][col] / a[col][col]
                a[r] = [v - f * p for v, p in zip(a[r], a[col], strict=True)]
        if det <= 1e-9 * max(bound, 1e-30):
            return None
        solved = [0.0] * len(index)
        for row in reversed(range(len(index))):
            rest = sum(a[row][j] * solved[j] for j in range(row + 1, len(index)))
            solved[row] = (a[row][-1] - rest) / a[row][row]
        return solved


@dataclass
class Positions:
    """Decayed counts per draft position (index k - 1 for the k-th draft token).

    Acceptance: ``trials[k - 1]`` verifies reached position k (its k - 1 tokens before were accepted and it was
    drafted), ``accepted[k - 1]`` of them accepted it. Continuation: ``offered[k - 1]`` drafts were planned at least k
    deep and drafted the k - 1 tokens before it, ``continued[k - 1]`` of them drafted the k-th too (a draft model
    ends its draft after a token it is unsure of, ``--speculative-draft-min-prob``; a planned draft always drafts its
    first token, or nothing at all). Positions never reached are absent (no record: the prior rules there)."""

    accepted: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)
    continued: list[float] = field(default_factory=list)
    offered: list[float] = field(default_factory=list)

    def decay(self, lam: float) -> None:
        for counts in (self.accepted, self.trials, self.continued, self.offered):
            counts[:] = [lam * c for c in counts]

    def add(self, drafted: int, accepted: int, planned: int | None = None) -> None:
        """One verify of ``drafted`` tokens (of ``planned``; default as many) of which the first ``accepted`` were
        kept."""
        reached = min(accepted + 1, drafted)
        _grow(self.trials, self.accepted, reached)
        for k in range(reached):
            self.trials[k] += 1.0
            self.accepted[k] += 1.0 if k < accepted else 0.0
        offered = min(drafted + 1, drafted if planned is None else planned)  # positions 2 .. offered were offered
        _grow(self.offered, self.continued, offered)
        for k in range(1, offered):
            self.offered[k] += 1.0
            self.continued[k] += 1.0 if k < drafted else 0.0

    def rates(self, priors: Sequence[float], strength: float) -> list[float]:
        """α at positions 1 .. len(``priors``): this record's rate at each, leaning on its prior with ``strength``
        trials."""
        return _leaning(self.accepted, self.trials, priors, strength)

    def continuations(self, priors: Sequence[float], strength: float) -> list[float]:
        """κ at positions 1 .. len(``priors``): how often a draft planned at least k deep that drafted its k - 1 tokens
        before drafts the k-th (1 at the first, whatever its prior), leaning on its prior with ``strength`` offers."""
        leaning = _leaning(self.continued, self.offered, priors, strength)
        return [1.0, *leaning[1:]] if leaning else leaning


def _grow(total: list[float], hits: list[float], length: int) -> None:
    while len(total) < length:
        total.append(0.0)
        hits.append(0.0)


def _leaning(hits: list[float], total: list[float], priors: Sequence[float], strength: float) -> list[float]:
    """(hits + strength·prior) / (total + strength) at each position of ``priors``; positions never counted have the
    prior alone. One pass per record, the engine-wide priors read once per plan: the rule reads every request's record
    at every depth on every step, and a position at a time (each with its prior) planning a step of 256 requests took
    2.3 ms of the scheduler's CPU, against 1.65 ms so (bench/spec_policy.py)."""
    counted = len(total)
    return [((hits[i] + strength * p) / (total[i] + strength)) if i < counted else p for i, p in enumerate(priors)]


@dataclass(frozen=True)
class _Modelled:
    """Per depth 0 .. d of a step's drafting requests: the accepted draft tokens, the draft tokens verified, and the
    longest draft's length (the draft's forwards)."""

    gained: list[float]
    rows: list[float]
    longest: list[float]

    @classmethod
    def of(cls, kappas: list[list[float]], alphas: list[list[float]], top: int) -> _Modelled:
        """Requests whose draft goes on to its k-th token with κ_k and has it accepted with α_k (once the k - 1
        before it were drafted, and accepted): Σ_r Σ_k≤d κ_r,1·α_r,1 ··· κ_r,k·α_r,k tokens accepted, Σ_r Σ_k≤d
        κ_r,1 ··· κ_r,k verified."""
        reached = [1.0] * len(alphas)  # the chance that request r's draft reaches its d-th token
        kept = [1.0] * len(alphas)  # the chance that it reaches it and every token up to it is accepted
        lengths = [0.0] * len(alphas)
        gained, rows, longest = [0.0], [0.0], [0.0]
        for d in range(top):
            reached = [p * ks[d] for p, ks in zip(reached, kappas, strict=True)]
            kept = [p * ks[d] * rates[d] for p, ks, rates in zip(kept, kappas, alphas, strict=True)]
            lengths = [length + p for length, p in zip(lengths, reached, strict=True)]
            gained.append(gained[-1] + sum(kept))
            rows.append(rows[-1] + sum(reached))
            longest.append(max(lengths, default=0.0))
        return cls(gained, rows, longest)


@dataclass
class RequestSpec:
    """One request's drafting record: its acceptance per draft position, and while paused the step it may draft
    again."""

    positions: Positions = field(default_factory=Positions)
    paused_until: int = 0
    pause: int = 0
    length: int = 0  # the request's tokens (prompt and outputs) when last planned: the scheduler sets it
    fed: int = 0  # its length, its drafts included, when it last drafted (0: never: its draft has seen nothing)
    left: int | None = None  # tokens it may still write (max_new_tokens less those planned; None: not known)
    written: int = 0  # its output tokens when last planned: the scheduler sets it

    def catch_up(self) -> int:
        """Tokens a draft model must read before drafting for this request: all since it last drafted (a request
        that never drafted: its prompt too), at least its pending token."""
        return max(self.length - self.fed, 1)

    def steps_left(self, per_step: float, horizon: float) -> float:
        """Steps it is expected to go on decoding at ``per_step`` tokens a step, at most ``horizon`` (a request may end
        early at its eos or a stop; one whose budget is not known is taken to go on that long), at least one."""
        return horizon if self.left is None else min(max(self.left / per_step, 1.0), horizon)


def _behind(requests: list[RequestSpec]) -> list[tuple[int, RequestSpec]]:
    """The requests whose drafts must read more than the steady token first, each with the tokens past it."""
    extra = ((r.catch_up() - 1, r) for r in requests)
    return [(tokens, r) for tokens, r in extra if tokens > 0]


@dataclass
class SpecPolicy:
    """Chooses draft depths; the scheduler reports every committed step and every verified run."""

    spec: SpeculativeConfig
    config: SpecPolicyConfig = SpecPolicyConfig()
    _verify: _LinearFit = field(init=False)
    _draft: _LinearFit = field(init=False)
    _engine: Positions = field(default_factory=Positions)  # every request's verifies: the per-position prior
    _step: int = 0
    _sizes: set[int] = field(default_factory=set)
    _explore_gap: int = 0
    _next_explore: int = 0
    _plain_gap: int = 0
    _next_plain: int = 0
    _explorers: set[int] | None = None  # id() of the exploring step's drafting requests; None: not exploring
    _explored_shallow: bool = False  # the last exploring step drafted depth 1 (see _exploring_depth)
    _catch_up: int = 0  # catch-up tokens of the requests drafting in the step being planned (take_catch_up)
    _verdict: BatchVerdict = field(init=False)  # a large batch: whole-batch drafting as measured

    def __post_init__(self) -> None:
        self._verify = _LinearFit(self.config.forgetting)
        self._draft = _LinearFit(self.config.forgetting, 4)
        self._verdict = BatchVerdict(self.config.verdict)
        self._explore_gap = self.config.explore_every
        self._plain_gap = self.config.explore_every
        self._next_plain = self.config.explore_every - 1

    # ---------------------------------------------------------------- choosing

    def batch_depth(self, requests: list[RequestSpec], quiet: bool = True) -> int:
        """The draft depth for a step whose decodes are ``requests``; ``quiet``: no other request is waiting or
        prefilling, so the step will be a pure decode step (the only kind whose cost a probe measures)."""
        top = self.spec.draft_nodes
        self._explorers = None
        cap = self.spec.disable_by_batch_size
        if cap and len(requests) > cap:
            return 0  # the operator's bound (--speculative-disable-by-batch-size): plain, and nothing explored
        if not self.spec.adaptive or top == 0 or not requests:
            return top
        verdict = self._judge(requests, quiet)
        if verdict is Verdict.PROBE:
            return top
        if verdict is Verdict.DRAFT:
            self._explore_gap = self.config.explore_every
            return self._probe_plain(top, self._verdict.ratio)
        if verdict is Verdict.PLAIN:
            return 0
        if verdict is Verdict.EXPLORE:
            return self._explore(requests)
        choice = self._best_depth(requests)
        if choice is None:
            return 0 if self._step % 2 else top  # learning: the cost model needs two step sizes to mean anything
        best, margin = choice
        if best == 0:
            return self._explore_drafting(requests)
        self._explore_gap = self.config.explore_every  # drafting pays: a plain step now and then keeps it honest
        return self._probe_plain(best, margin)

    def _judge(self, requests: list[RequestSpec], quiet: bool) -> Verdict | None:
        """The measured verdict on the whole batch drafting (None: a batch too small for it; the model decides)."""
        live = [r for r in requests if self._step >= r.paused_until]
        if len(live) < self._verdict.config.from_requests:
            return None
        horizon = self._verdict.config.life_horizon
        life = self._verdict.life_tokens([(r.written, horizon if r.left is None else r.left) for r in live])
        behind = _behind(live)
        if not behind:
            return self._verdict.judge(len(live), self._step, 0.0, 0.0, quiet, life)
        per_token = self._draft_weights()[3]
        catch_up = per_token * sum(tokens for tokens, _ in behind)
        switch = per_token * self._switch_share(behind, life or self._verdict.tokens)
        return self._verdict.judge(len(live), self._step, catch_up, switch, quiet, life)

    def _probe_plain(self, best: int, margin: float) -> int:
        """While drafting pays: ``best``, but depth 0 once per gap. The gap is ``explore_every`` while the margin of
        drafting over plain is thin, and doubles (up to ``max_plain_gap``) after each probe while it is wide."""
        wide = margin >= self.config.wide_margin
        if not wide:
            self._plain_gap = self.config.explore_every
            self._next_plain = min(self._next_plain, self._step + self._plain_gap)
        if self._step < self._next_plain:
            return best
        self._next_plain = self._step + self._plain_gap
        if wide:
            self._plain_gap = min(2 * self._plain_gap, self.config.max_plain_gap)
        return 0

    def _explore_drafting(self, requests: list[RequestSpec]) -> int:
        """While plain decoding wins: the full depth once per gap, the gap doubling (up to ``max_explore_every``)
        each time the rule still says plain afterwards. A drafting step over a large batch is the costly kind of
        exploration (a draft model first catches up on every token since it last drafted, then the verify runs the
        whole batch's drafts): at 32 streams each one cost as much as five plain steps, so a fixed period of 16 lost
        about a fifth of the throughput that "never slower" is there to keep."""
        if self._step < self._next_explore:
            return 0
        self._next_explore = self._step + self._explore_gap
        self._explore_gap = min(2 * self._explore_gap, self.config.max_explore_every)
        return self._explore(requests)

    def _explore(self, requests: list[RequestSpec]) -> int:
        """An exploring step's depth, its drafting requests chosen."""
        # Only a few requests draft: their verifies and the step's size say what drafting would pay, and the cost of
        # finding out stays small. Those whose drafts are the most caught up: each drafting request's draft model
        # first reads everything it missed (at 32 streams, a request that never drafted or last explored 128 steps
        # ago reads 100-250 tokens, the draft's time of a plain step or two).
        live = sorted((r for r in requests if self._step >= r.paused_until), key=RequestSpec.catch_up)
        self._explorers = {id(r) for r in live[: self.config.explore_requests]}
        return self._exploring_depth()

    def _exploring_depth(self) -> int:
        """The full depth; but while every drafting step seen had one depth (so the fit cannot tell a call's cost from
        its depth's, and takes the call's alone: a shallow draft no cheaper than a deep one), depth 1 every other
        time, so that a draft whose every depth costs (a forward per depth) is found cheap when shallow."""
        top = self.spec.draft_nodes
        self._explored_shallow = self._draft.weights((0, 1)) is None and not self._explored_shallow
        return 1 if self._explored_shallow else top

    def request_depth(self, req: RequestSpec, batch_depth: int) -> int:
        """The depth of one request of the step planned at ``batch_depth`` (asked in the step's order)."""
        if not self.spec.adaptive:
            return batch_depth
        if self._step < req.paused_until:
            return 0
        if self._explorers is not None and id(req) not in self._explorers:  # an exploring step: its explorers draft
            return 0
        if batch_depth:
            self._catch_up += req.catch_up()
            req.fed = req.length + batch_depth
        return batch_depth

    def take_catch_up(self) -> int:
        """The catch-up tokens of the requests given a depth since the last call: the planned step's, reported back
        with its cost (observe_step)."""
        taken, self._catch_up = self._catch_up, 0
        return taken

    def alphas(self, req: RequestSpec, depth: int) -> list[float]:
        """α_1 .. α_depth for ``req``: its own rate at each position, leaning on the engine-wide one there."""
        return req.positions.rates(self._alpha_priors(depth), self.config.prior_tokens)

    def _alpha_priors(self, depth: int) -> list[float]:
        """The engine-wide α at positions 1 .. ``depth``: every request's prior, read once per plan."""
        # The engine-wide rate itself leans on an even prior of the same weight, so that it is never exactly 0 or 1.
        return self._engine.rates([0.5] * depth, self.config.prior_tokens)

    def _kappa_priors(self, depth: int) -> list[float]:
        """The engine-wide κ at positions 1 .. ``depth``, which leans on 1: a proposer that never ends a draft early
        drafts every position."""
        return self._engine.continuations([1.0] * depth, self.config.prior_tokens)

    def _optimistic(self, req: RequestSpec, rates: list[float], optimism: float) -> list[float]:
        """``rates`` (``req``'s α) plus ``optimism`` standard errors of each estimate (its own trials and the prior's
        weight), at most 1."""
        k, trials = self.config.prior_tokens, req.positions.trials
        return [
            min(1.0, a + optimism * math.sqrt(a * (1.0 - a) / ((trials[i] if i < len(trials) else 0.0) + k + 1.0)))
            for i, a in enumerate(rates)
        ]

    def continuations(self, req: RequestSpec, depth: int) -> list[float]:
        """κ_1 .. κ_depth for ``req``: how often its draft goes on to each position (κ_1 = 1), leaning on the
        engine-wide rate there, which leans on 1: a proposer that never ends a draft early drafts every position."""
        return req.positions.continuations(self._kappa_priors(depth), self.config.prior_tokens)

    def alpha(self, req: RequestSpec) -> float:
        """α_1: how often ``req``'s first draft token is accepted (what pauses a request whose drafts fail)."""
        return self.alphas(req, 1)[0]

    def _best_depth(self, requests: list[RequestSpec]) -> tuple[int, float] | None:
        """The depth with the most modelled tokens per second, and its rate over plain decoding's (None: the cost
        model cannot tell yet)."""
        verify = self._verify.weights()
        if verify is None or len(self._sizes) < 2:
            return None
        a, b = verify
        c0, c, e, f = self._draft_weights()
        top = self.spec.draft_nodes
        live = [r for r in requests if self._step >= r.paused_until]
        n, drafting = len(requests), len(live)
        # Chosen with each request's acceptance optimistic by optimism / B² standard errors (B drafting requests):
        # the choice is made on few verifies of a young request; judged (the margin) by the estimates themselves.
        optimism = self.config.optimism / drafting**2 if drafting else 0.0
        k = self.config.prior_tokens
        alpha_priors, kappa_priors = self._alpha_priors(top), self._kappa_priors(top)
        kappas = [r.positions.continuations(kappa_priors, k) for r in live]
        alphas = [r.positions.rates(alpha_priors, k) for r in live]
        chosen = [self._optimistic(r, rates, optimism) for r, rates in zip(live, alphas, strict=True)]
        model = _Modelled.of(kappas, chosen, top)
        expected = _Modelled.of(kappas, alphas, top).gained if optimism else model.gained
        plain_rate = n / (a + b * n) if a + b * n > 0 else 0.0
        point, seconds = [plain_rate], [a + b * n]  # per depth: modelled tokens per second, and the step's seconds
        behind = _behind(live)
        for d in range(1, top + 1):
            # The draft's forwards: as many as its longest draft is modelled to run (d where no draft ends early). Its
            # catch-up: a token per request at the steady state, and what a request whose draft is behind (it decoded
            # plainly) reads once, spread over the steps it is expected to go on drafting (switch_share).
            forwards = model.longest[d]
            switch = self._switch_share(behind, 1.0 + model.gained[d] / drafting) if drafting else 0.0
            seconds.append(a + b * (n + model.rows[d]) + c0 + forwards * (c + e * drafting) + f * (drafting + switch))
            point.append((n + model.gained[d]) / seconds[d] if seconds[d] > 0 else 0.0)
        best = max(range(top + 1), key=lambda d: point[d])
        # A narrow modelled win must hold at the verify's upper estimate: a drafting step's size often lies far beyond
        # the plain steps the fit mostly saw, and a slope fitted on steps of nearly one size on a loaded host is mostly
        # noise there (a slope fitted at 0 or below is nothing else). A wide win is taken as modelled: where drafting
        # has not been measured for a while its upper estimate is wide too, and would keep plain a stream that drafting
        # speeds up twofold.
        if best and (point[best] < self.config.sure_margin * plain_rate or b <= 0.0):
            spreads = self._verify.spreads([(1.0, n + model.rows[d]) for d in range(1, top + 1)])
            upper = [plain_rate]
            for d, spread in enumerate(spreads, start=1):
                slowest = seconds[d] + self.config.confidence * spread
                upper.append(point[d] * seconds[d] / slowest if slowest > 0 else 0.0)
            best = max(range(top + 1), key=lambda d: upper[d])
        rate = (n + expected[best]) / seconds[best] if seconds[best] > 0 else 0.0
        return best, (rate / plain_rate if plain_rate > 0 else float("inf"))

    def _switch_share(self, behind: list[tuple[int, RequestSpec]], per_step: float) -> float:
        """Catch-up tokens a step that drafts for ``behind`` (each with the tokens its draft has still to read past the
        steady one) is charged: each request's spread over the steps it has left at ``per_step`` tokens a step, at
        most ``switch_horizon``. A switch to drafting costs that catch-up once, and pays only if the steps after it
        win it back: at 32 streams on the bench's fresh prompts, a switch 23 steps before the batch's end read 1068
        tokens (27 ms, the time of 3.5 plain steps) for a modelled win of 5% a step, and lost. Charged whole to the
        first step instead, it would grow with every plain step and drafting would never start again; spread over
        the rest of a long request it costs a lone stream, whose win is twofold, next to nothing."""
        horizon = self.config.switch_horizon
        return sum(extra / req.steps_left(per_step, horizon) for extra, req in behind)

    def _draft_weights(self) -> list[float]:
        """(c0, c, e, f) of the draft cost, from the features the drafting steps seen so far tell apart, every weight
        a cost (not negative): all four; without the depth (every step at one depth, the batch varying; or a batch
        that barely varies, where depth and drafted tokens move together and a fit with both returns opposite
        signs); the call and the catch-up alone; then the same without the catch-up (a proposer that reads nothing
        to catch up, n-gram lookup, or steps whose catch-ups were all alike); or the call alone (every step alike:
        its cost, whatever the depth, the least a deeper draft can be said to cost)."""
        for use in ((0, 1, 2, 3), (0, 2, 3), (0, 3), (0, 1, 2), (0, 2), (0,)):
            weights = self._draft.weights(use)
            # A weight a hair below 0 is rounding (a cost that is in fact 0); a clearly negative one is the fit
            # trading one collinear feature against another.
            if weights is not None and min(weights) >= -0.05 * max(abs(w) for w in weights):
                return [max(w, 0.0) for w in weights]
        return [0.0, 0.0, 0.0, 0.0]

    # ---------------------------------------------------------------- observing

    def observe_step(
        self,
        forward_tokens: int,
        depth: int,
        drafted: int,
        seconds: float,
        draft_seconds: float,
        catch_up: int = 0,
        planned: PlannedBatch | None = None,
    ) -> None:
        """A committed pure decode step, ``planned`` as it was (None: not told, and the measured verdict learns
        nothing from it): ``forward_tokens`` through the model, ``drafted`` requests drafted at ``depth`` with
        ``catch_up`` tokens to read first (take_catch_up when it was planned); the executor took ``seconds``,
        ``draft_seconds`` of them in the proposer."""
        self._step += 1
        if not drafted:  # the engine-wide rates fade in time as a request's do (observe_request)
            self._engine.decay(self.config.forgetting)
        if planned is None:
            self._verdict.close_step()
        else:
            self._verdict.observe_step(planned, self.spec.draft_nodes, seconds, catch_up, self._step)
        if not self.spec.adaptive or seconds <= 0.0:
            return
        self._verify.add((1.0, float(forward_tokens)), seconds - draft_seconds)
        if len(self._sizes) < 2:
            self._sizes.add(forward_tokens)
        if depth and drafted:
            self._draft.add((1.0, float(depth), float(depth * drafted), float(catch_up)), draft_seconds)

    def tick(self) -> None:
        """A step that says nothing about the cost (a prefill chunk in it) still counts for pauses and exploring."""
        self._step += 1
        self._verdict.close_step()

    def observe_request(self, req: RequestSpec, drafted: int, accepted: int, planned: int | None = None) -> None:
        """A verified run of ``req``: ``drafted`` draft tokens of the ``planned`` (default as many), the first
        ``accepted`` of them kept."""
        lam = self.config.forgetting
        # Forgotten in time too, not only by newer verifies: a request that stopped drafting on a poor start (a rate
        # that rules depth 0 gets no verify to correct it) drifts back to the prior and is tried again.
        req.positions.decay(lam)
        if (drafted if planned is None else planned) == self.spec.draft_nodes:
            # A full-depth draft's tokens, drafted or not (an n-gram lookup that found no match kept one).
            self._verdict.observe_verify(accepted, req.written)
        if not drafted:
            return
        req.positions.add(drafted, accepted, planned)
        self._engine.decay(lam)
        self._engine.add(drafted, accepted, planned)
        if accepted:
            req.pause = 0
        elif self.alpha(req) < self.config.min_alpha:
            req.pause = min(max(req.pause * 2, self.config.pause), self.config.max_pause)
            req.paused_until = self._step + req.pause
