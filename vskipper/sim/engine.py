"""The simulator: SGLang 0.5.23's scheduler loop over a trace of requests, each step priced by a step model.

One iteration is SGLang's `event_loop_overlap` (scheduler.py): take in the requests that arrived, form the
next batch (`get_next_batch_to_run`), run it, then process the previous batch's results. Forming a batch:

- the last prefill batch's requests have joined the running batch; finished requests have left it;
- prefill first (`_get_new_batch_prefill_raw` and `PrefillAdder`, schedule_policy.py): the request being
  chunked continues; then the waiting queue in FCFS order, while the pass has budget: at most
  `--max-running-requests` running, a request admitted only if its prompt plus its reserved output
  (`min(max_new_tokens - out, 4096)`, all of it under ignore_eos, else times the new-token ratio) plus a page
  fit in the KV left (`--max-total-tokens` less what the running requests hold and reserve, and what this
  pass admitted), the pass's new tokens capped by `--chunked-prefill-size` (a request past it is cut there
  and continues in the next passes, decode waiting meanwhile) and `--max-prefill-tokens`; a request that
  does not fit marks the batch full, and no prefill is tried until a running request leaves;
- else a decode step of every running request (`update_running_batch`): with the overlap scheduler a
  request whose last token is still in flight is left out when it ended by length, and runs once more when
  it ended at EOS (its result not yet read); if the next step's tokens do not fit, requests are retracted
  (`retract_decode`: fewest output tokens first, then longest prompt; freed, back at the end of the queue,
  their prompt and output so far prefilled again) and the ratio re-estimated; else it decays toward its
  minimum; an idle server resets it.

A prefill step produces each finished prompt's first token, a decode step one token per row. Emission: with
`host.serial` (a CPU, where SGLang's "overlap" runs the forward on the scheduler's own core) the previous
batch's results are processed after the next batch's forward, so a step's tokens reach the client when the
next step ends (at once when none follows); otherwise (a GPU) the host work hides behind the forward and a
step's tokens leave when it ends. Requests reach the scheduler `ingress_ms` after they are sent, tokens the
client `egress_ms` after they leave. Not modelled: prefix (radix-cache) hits, mixed prefill-decode batches
(off by default), priorities, aborts, a second process competing for the device.

A loop of our own, not simpy or vidur: the scheduler is one sequential loop (no concurrent processes to
coordinate, only arrivals, which a sorted list holds), so simpy's generators would add cost and nothing
else; vidur's schedulers are vLLM's, Sarathi's and Orca's, not SGLang's adder, ratio and retraction. Every
running request advances one token per decode step, so the loop keeps sums (rows, context, reservation)
and a table of which step each request finishes in, and costs O(1) per step and O(log) per request: a
10-minute trace at 50 requests/s runs in a few seconds on one core (tests/test_sim_speed.py).
"""
from __future__ import annotations

import heapq
from collections import deque

from vskipper.sim.metrics import SimResult
from vskipper.sim.server import CLIP_MAX_NEW_TOKENS, ServerConfig
from vskipper.sim.steps import Host, StepModel
from vskipper.sim.workload import Request

__all__ = ["simulate"]


class _Req:
    __slots__ = ("i", "arrival", "prompt", "target", "max_new", "ign", "out", "fill", "done", "d0", "c", "R",
                 "gen", "running", "long", "segs", "finish_d")

    def __init__(self, i: int, r: Request):
        self.i, self.arrival, self.prompt = i, r.arrival, r.prompt
        self.max_new, self.ign = r.max_new_tokens, r.ignore_eos
        self.target = r.output  # tokens it generates in all
        self.out = 0  # tokens generated before the current fill (retraction keeps them)
        self.fill = r.prompt  # tokens this round's prefill writes (prompt, plus the output after a retraction)
        self.done = 0  # of them, written so far (chunked prefill)
        self.gen = 0  # bumped on retraction: finish-table entries of an older life are stale
        self.running = False
        self.long = False
        self.segs: list = []  # per life: [its first token's emission time, first decode index, last decode index]


def simulate(requests: list[Request], steps: StepModel, host: Host | None = None,
             server: ServerConfig | None = None, record_batches: bool = True) -> SimResult:
    """Run the trace through the simulated server; returns per-request times and per-step records."""
    return _Sim(requests, steps, host or Host(), server or ServerConfig(), record_batches).run()


class _Sim:
    def __init__(self, requests, steps, host, cfg, record):
        if not requests:
            raise ValueError("simulate: no requests")
        self.reqs = [_Req(i, r) for i, r in enumerate(sorted(requests, key=lambda r: r.arrival))]
        for r in self.reqs:
            if r.prompt + min(r.max_new, CLIP_MAX_NEW_TOKENS) + 1 >= cfg.max_total_tokens:
                raise ValueError(f"request {r.i}: prompt {r.prompt} + max_new_tokens {r.max_new} tokens can never be "
                                 f"admitted under --max-total-tokens {cfg.max_total_tokens}")
        self.m, self.h, self.cfg, self.record = steps, host, cfg, record
        self.ratio = cfg.ratio_init
        self.waiting: deque[_Req] = deque()
        self.chunked: _Req | None = None
        self.chunk_used = 0  # KV held by the request being chunked
        self.batch_full = False
        self.D = 0  # decode steps run
        self.n = 0  # running requests
        self.sum_c = 0.0  # sum over running of c = fill - d0 (+1): context of a row at decode D is c + D
        self.res_R = [0.0, 0.0]  # sum of R = max_new - out_at_join + d0 over running, [ratio-scaled, ignore_eos]
        self.res_n = [0, 0]
        self.long_heap: list = []  # (R - CLIP, i, gen) of requests whose reservation is still clipped
        self.long_n = [0, 0]
        self.run_set: dict[int, _Req] = {}
        self.finish: dict[int, list] = {}  # decode index -> [(req, gen)] whose last token it makes
        self.emit_dec: list[float] = []  # emission time of each decode step's tokens
        self.weights: list[int] = []  # rows of each decode step whose previous token came from the one before
        self.joined: dict[int, int] = {}  # decode index -> rows that joined before it
        self.steps_rec: list = []  # (start, duration, kind 0 decode / 1 prefill, rows, tokens)
        self.priced: dict[str, float] = {}
        self.retractions = 0

    # ---- running-set bookkeeping -------------------------------------------------------------
    def _join(self, r: _Req) -> None:
        """r's prefill is done (its first token of this life is in flight): it runs from decode D."""
        D = self.D
        r.d0, r.running = D, True
        r.out += 1  # the prefill's token
        r.c = r.fill - D + 1
        r.R = r.max_new - r.out + D
        self.n += 1
        self.sum_c += r.c
        k = 1 if r.ign else 0
        if r.R - D > CLIP_MAX_NEW_TOKENS:
            r.long = True
            self.long_n[k] += 1
            heapq.heappush(self.long_heap, (r.R - CLIP_MAX_NEW_TOKENS, r.i, r.gen))
        else:
            r.long = False
            self.res_R[k] += r.R
            self.res_n[k] += 1
        r.finish_d = D + (r.target - r.out) - 1  # the decode step making its last token (D - 1: the prefill's)
        self.run_set[r.i] = r
        if r.finish_d >= D:
            self.joined[D] = self.joined.get(D, 0) + 1
            self.finish.setdefault(r.finish_d, []).append((r, r.gen))

    def _leave(self, r: _Req) -> None:
        self.n -= 1
        self.sum_c -= r.c
        k = 1 if r.ign else 0
        if r.long:
            self.long_n[k] -= 1
        else:
            self.res_R[k] -= r.R
            self.res_n[k] -= 1
        r.running = False
        del self.run_set[r.i]
        self.batch_full = False

    def _used(self) -> float:
        return self.sum_c - self.n + self.n * self.D + self.chunk_used

    def _reserved(self) -> float:
        D, heap = self.D, self.long_heap
        while heap and heap[0][0] <= D:
            _, i, gen = heapq.heappop(heap)
            r = self.reqs[i]
            if r.gen == gen and r.running and r.long:
                k = 1 if r.ign else 0
                r.long = False
                self.long_n[k] -= 1
                self.res_R[k] += r.R
                self.res_n[k] += 1
        ign = self.res_R[1] - self.res_n[1] * D + self.long_n[1] * CLIP_MAX_NEW_TOKENS
        oth = self.res_R[0] - self.res_n[0] * D + self.long_n[0] * CLIP_MAX_NEW_TOKENS
        return ign + self.ratio * oth

    # ---- forming a batch ---------------------------------------------------------------------
    def _prefill(self):
        cfg = self.cfg
        if self.n == 0:
            self.batch_full = False
        if (self.batch_full or not self.waiting) and self.chunked is None:
            return None
        if cfg.max_running_requests - self.n <= 0 and self.chunked is None:
            self.batch_full = True
            return None
        cap = cfg.max_total_tokens
        used = self._used()
        rem_total = cap - used - self._reserved()
        rem_cur = cap - used
        rem_in = cfg.max_prefill_tokens
        rem_chunk = cfg.chunked_prefill_size
        pieces = []  # (req, extend, prefix, completes)
        if self.chunked is not None:
            r = self.chunked
            avail = min(rem_chunk, int(rem_total)) if rem_chunk is not None else r.fill - r.done
            if avail <= 0:
                avail = rem_chunk
            left = r.fill - r.done
            ext = min(left, avail)
            trunc = left > ext
            reserve = 0 if trunc else min(r.max_new - r.out, CLIP_MAX_NEW_TOKENS)
            rem_total -= ext + 1 + reserve
            rem_cur -= ext + 1
            rem_in -= ext
            if rem_chunk is not None:
                rem_chunk -= ext
            pieces.append((r, ext, r.done, not trunc))
            if not trunc:
                self.chunked = None
        new_chunked = None
        admitted = 0
        for r in self.waiting:
            if rem_in <= 0 or (rem_chunk is not None and rem_chunk <= 0):
                break
            if len(pieces) >= cfg.max_running_requests - self.n:
                self.batch_full = True
                break
            reserve = min(r.max_new - r.out, CLIP_MAX_NEW_TOKENS)
            if not r.fill + reserve + 1 < rem_total:
                self.batch_full = bool(pieces) or self.n > 0
                break
            if rem_chunk is None and pieces and r.fill >= rem_in:
                break
            ext, trunc = r.fill, False
            if rem_chunk is not None and ext > rem_chunk:
                ext, trunc = rem_chunk, True
            pieces.append((r, ext, 0, not trunc))
            admitted += 1
            rem_total -= ext + 1 + (0 if trunc else reserve)
            rem_cur -= ext + 1
            rem_in -= ext
            if rem_chunk is not None:
                rem_chunk -= ext
            if trunc:
                new_chunked = r
            if rem_total <= 0 or rem_cur <= 0:
                self.batch_full = True
                break
        if not pieces:
            return None
        for _ in range(admitted):
            self.waiting.popleft()
        if new_chunked is not None:
            self.chunked = new_chunked
        return pieces

    def _decode(self, pending):
        """The decode batch (rows, context, dead rows) or None; retracts where the KV is short."""
        D = self.D
        if pending is not None and pending[0] == 1:
            finals = [r for r in pending[2] if r.running and r.finish_d == D - 1]
        else:
            finals = [r for r, g in self.finish.get(D - 1, ()) if r.running and r.gen == g]
        by_len = [r for r in finals if r.ign or r.target >= r.max_new]
        dead = len(finals) - len(by_len)
        rows = self.n - len(by_len)
        if rows <= 0:
            return None
        free = self.cfg.max_total_tokens - self._used()
        if free < rows:
            if by_len:  # their KV comes back when the step in flight is processed: decode next time
                self.batch_full = False
                return None
            rows, dead = self._retract(finals, dead, free)
        else:
            self.ratio = max(self.ratio - self.cfg.ratio_decay, self.cfg.ratio_min)
        gone = set(id(r) for r in by_len)
        ctx = self.sum_c + self.n * D - sum(r.c + D for r in by_len)
        return rows, ctx, dead, gone

    def _retract(self, finals: list, dead: int, free: float) -> tuple[int, int]:
        """retract_decode: free rows (fewest output tokens, then longest prompt, first) until the step fits,
        at least one, keeping one; the rows in their last step are left alone here."""
        D = self.D
        skip = set(id(r) for r in finals)
        batch = [r for r in self.run_set.values() if id(r) not in skip]
        batch.sort(key=lambda r: (r.out + D - r.d0, -r.prompt), reverse=True)
        first = True
        while first or free < len(batch) + dead:
            if len(batch) == 1:
                break
            first = False
            r = batch.pop()
            held = r.c - 1 + D
            self._leave(r)
            free += held
            r.out += D - r.d0  # its tokens so far stay; the next prefill writes them again
            r.segs[-1][2] = D - 1
            r.gen += 1
            r.fill, r.done = r.prompt + r.out, 0
            self.waiting.append(r)
            self.retractions += 1
        out = sum(r.out + D - r.d0 for r in batch)
        self.ratio = min(1.0, (out + self.cfg.retract_decode_steps * len(batch)) / (sum(r.max_new for r in batch) + 1))
        return len(batch) + dead, dead

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> SimResult:
        m, h, cfg = self.m, self.h, self.cfg
        ingress, egress = h.ingress_ms / 1e3, h.egress_ms / 1e3
        (h0, h1), (g0, g1) = h.decode_ms, h.extend_ms
        serial = h.serial
        arrivals = [r.arrival + ingress for r in self.reqs]
        n_req, ai = len(self.reqs), 0
        t = 0.0
        pending = None  # the batch whose results are unprocessed: (0, decode index) or (1, step end, [reqs done])
        rec = self.steps_rec if self.record else None
        priced = self.priced
        tags: dict[int, str] = {}
        finished = 0
        while finished < n_req:
            while ai < n_req and arrivals[ai] <= t:
                self.waiting.append(self.reqs[ai])
                ai += 1
            pieces = self._prefill()
            batch = None
            if pieces is not None:
                tokens = sum(p[1] for p in pieces)
                pairs = sum(p[1] * (p[2] + (p[1] + 1) / 2) for p in pieces)
                eng = m.extend_ms(tokens, len(pieces), pairs)
                hs = g0 + g1 * len(pieces)
                batch = (1, pieces, tokens)
                key = "extend"
            elif self.n > 0:
                dec = self._decode(pending)
                if dec is not None:
                    rows, ctx, dead, gone = dec
                    eng = m.decode_ms(rows, ctx)
                    hs = h0 + h1 * rows
                    batch = (0, rows, dead, gone)
                    key = tags.get(rows) or tags.setdefault(rows, self._tag(rows))
            if batch is None:
                if pending is not None:
                    finished += self._process(pending, t)
                    pending = None
                    continue
                if self.n == 0 and self.chunked is None:
                    self.ratio = cfg.ratio_init  # on_idle
                if ai < n_req:  # nothing to run until the next arrival
                    t = max(t, arrivals[ai])
                    continue
                raise RuntimeError(f"simulate: stuck with {len(self.waiting)} waiting and {self.n} running "
                                   f"requests and nothing to run")
            ms = eng + hs if serial else max(eng, hs)
            start = t
            t += ms / 1e3
            priced[key] = priced.get(key, 0.0) + ms / 1e3
            if batch[0] == 1:
                done = []
                for r, ext, prefix, completes in batch[1]:
                    r.done += ext
                    if completes:
                        self.chunk_used -= prefix  # its earlier chunks' KV moves to the running sums
                        done.append(r)
                    else:
                        self.chunk_used += ext
                if self.n == 0 and done:  # an empty running batch is replaced by this one, its flag unset
                    self.batch_full = False
                for r in done:
                    self._join(r)
                    r.segs.append([None, r.d0, None])
                cur = (1, t, done)
                if rec is not None:
                    rec.append((start, ms / 1e3, 1, len(batch[1]), batch[2]))
            else:
                _, rows, dead, gone = batch
                d = self.D
                self.weights.append(rows - dead - self.joined.pop(d, 0))
                self.emit_dec.append(0.0)
                self.D += 1
                cur = (0, d, t)
                if rec is not None:
                    rec.append((start, ms / 1e3, 0, rows, rows))
            if pending is not None:
                finished += self._process(pending, t)
            if serial:
                pending = cur
            else:  # the host work hides behind the forward: its tokens leave as it ends
                finished += self._process(cur, t, result_only=True)
                pending = cur
        return SimResult.build(self, egress)

    def _tag(self, rows: int) -> str:
        """Where a decode step of `rows` is priced: within the batch sizes of measured cells (at one, or between
        two), or past them (modelled or extrapolated cells)."""
        top = self.m.measured_max
        return "decode within measured B" if top is not None and rows <= top else "decode past measured B"

    def _process(self, batch, t: float, result_only: bool = False) -> int:
        """Its tokens leave at t; its finished requests leave the running batch. Under a hidden host the
        emission is set as the step ends (result_only) and the leaving happens when the next batch is formed
        after it (here: at its own processing, which follows)."""
        finished = 0
        if batch[0] == 1:
            for r in batch[2]:
                if r.segs[-1][0] is None:
                    r.segs[-1][0] = batch[1] if not self.h.serial else t
                if result_only:
                    continue
                if r.running and r.finish_d == r.d0 - 1:  # its one token of this life was the prefill's
                    self._leave(r)
                    finished += 1
            return finished
        d = batch[1]
        if self.emit_dec[d] == 0.0:
            self.emit_dec[d] = batch[2] if not self.h.serial else t
        if result_only:
            return 0
        for r, g in self.finish.pop(d, ()):
            if r.running and r.gen == g:
                self._leave(r)
                r.segs[-1][2] = d
                finished += 1
        return finished
