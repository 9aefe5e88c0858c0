import type { AcquireRequest, AcquireResult, HoldsHere, LockMode, LockState, LockStore, ReleaseWatch, RenewRequest, TakeAlong } from '../lock-store.js';
import type { RedisLockStore, StoreLogger } from '../redis/redis-lock.store.js';
import { LockConfigurationError } from '../../errors/lock-configuration.error.js';
import { LockQuorumError, type RedlockVote } from '../../errors/lock-quorum.error.js';
import { now, realTime, withTimeout } from '../../internal/time.js';
import { heldLockId } from '../../held-lock.js';

/** One Redlock node: an independent master with its own store (scripts, release channel). */
export interface RedlockNode {
  /** `host:port`, for messages and votes. */
  name: string;
  store: RedisLockStore;
}

type Answer<T> = { ok: true; value: T } | { ok: false; error: string };

/** Resolves on the next turn of the event loop, after the I/O callbacks of this one (replies read together included). */
const nextTurn = (): Promise<void> => new Promise((resolve) => realTime.setImmediate(resolve));

/** One owner's attempts on one side of one lock. */
/**
 * Per-node timeout of one acquisition or renewal: a tenth of the lease, from 50 to 500 ms (a down
 * node must not eat the validity), and at most half the step timeout. So it stays well below the
 * step timeout that LockService gives any acquisition attempt at least, and a call that does not
 * wait (waitMs under it) gets this store's answer (LockQuorumError with each node's vote) rather
 * than LockService's own "no answer" bound.
 */
const nodeTimeout = (leaseMs: number, stepTimeoutMs: number) => Math.min(Math.max(Math.floor(leaseMs / 10), 50), 500, Math.floor(stepTimeoutMs / 2));

/**
 * The Redlock algorithm over N independent masters (N odd, at least 3), each running the same
 * scripts as a single server:
 *
 * - acquire: the attempt runs on every node in parallel (each bounded by a small timeout); it is
 *   granted when a quorum (⌊N/2⌋+1) granted it and the lock is still valid: lease − time spent −
 *   lease × driftFactor − 2 ms > 0. Otherwise every node that granted is given its hold back (a
 *   node that answers late is given it back when it answers) and the attempt counts as contended,
 *   or fails with LockQuorumError when too few nodes answered at all;
 * - renew: a lock stays held while a quorum renews it; when a majority said no it is lost; when
 *   too few answered the renewal is retried (the local deadline still ends it);
 * - release and force-unlock go to every node; inspect reports what a quorum agrees on.
 *
 * Every step returns as soon as the answers so far decide it (see `gather`): a node that is down
 * or frozen costs a step nothing while the others make up a quorum, instead of its whole timeout.
 * Its commands stay queued on its connection, in order, and run if it comes back.
 *
 * Fencing tokens are not issued: counters on independent masters cannot be made monotonic
 * together (a token is NaN, and `LockHandle.fencingToken` throws). Fair mode is refused.
 */
export class RedlockStore implements LockStore {
  readonly description: string;
  /** Each step waits for a node at most stepTimeoutMs (acquisitions and renewals: the node timeout). */
  readonly boundsSteps = true;
  readonly quorum: number;
  readonly supportsFairMode = false;
  /** The nodes warned about for failing a check of ready() (see there). */
  private readonly warned = new Set<number>();
  /** Per node: how many failed attempts it has not answered yet, by owner, key and mode (see `unsettled`). */
  private readonly unanswered: Map<string, number>[];

  constructor(
    private readonly nodes: readonly RedlockNode[],
    readonly driftFactor: number,
    /** How long steps without a lease (inspect, release, force-unlock, abandon) wait for a node: the module's stepTimeoutMs. */
    private readonly stepTimeoutMs: number,
    private readonly log?: StoreLogger,
  ) {
    this.quorum = Math.floor(nodes.length / 2) + 1;
    this.unanswered = nodes.map(() => new Map());
    this.description = `redlock over ${nodes.map((n) => n.name).join(', ')}`;
  }

  connect(): void {
    for (const node of this.nodes) node.store.connect();
  }

  /**
   * Ready once a quorum of nodes answered and loaded the scripts; the others join when they come up.
   * A node that failed a bootstrap check (a replica, a Redis older than 6.2, a closed client) will
   * not come up by itself: it is warned about, once, whether it answered before the quorum or after.
   */
  async ready(timeoutMs: number): Promise<void> {
    const answers: Answer<void>[] = new Array(this.nodes.length);
    let ok = 0;
    let settled = 0;
    const misconfigured: [number, string][] = [];
    const warn = ([i, text]: [number, string]) => {
      // Once per node: health() calls ready() on every probe.
      if (this.warned.has(i)) return;
      this.warned.add(i);
      this.log?.warn(`${text} Redlock went on without this node: locks need ${this.quorum} of ${this.nodes.length} nodes, and have one node fewer to spare until it is fixed.`);
    };
    await new Promise<void>((resolve, reject) => {
      const timer = realTime.setTimeout(() => reject(this.quorumError('bootstrap', '', answers)), timeoutMs);
      timer.unref();
      this.nodes.forEach((node, i) => {
        node.store.ready(timeoutMs).then(
          () => {
            answers[i] = { ok: true, value: undefined };
            if (++ok === this.quorum) {
              realTime.clearTimeout(timer);
              misconfigured.splice(0).forEach(warn);
              resolve();
            }
          },
          (e: unknown) => {
            answers[i] = { ok: false, error: message(e) };
            if (!(e instanceof LockConfigurationError)) return;
            if (ok >= this.quorum) warn([i, e.message]);
            else misconfigured.push([i, e.message]);
          },
        ).finally(() => {
          if (++settled === this.nodes.length && ok < this.quorum) {
            realTime.clearTimeout(timer);
            reject(this.quorumError('bootstrap', '', answers));
          }
        });
      });
    });
  }

  async acquire(request: AcquireRequest): Promise<AcquireResult> {
    const { key, owner, leaseMs, mode = 'exclusive' } = request;
    const start = now();
    // A node that answers after the quorum granted the lock answers about a hold the caller counts
    // already (see HoldsHere): it expects one hold fewer beyond that count.
    let counted = false;
    const { holdsHere } = request;
    const nodeHolds: HoldsHere | undefined = holdsHere && ((o, k, m) => {
      const holds = holdsHere(o, k, m);
      return holds === undefined || !counted ? holds : holds - 1;
    });
    // A node that has not answered a failed attempt of this owner on this lock yet may grant that
    // attempt before this one, and take its hold back only after: this one is then a re-entry of
    // it there, its hold count one too high (see `unsettled`).
    // Nothing to look up while no node has a failed attempt unanswered, the usual case.
    let inflated: number[] | undefined;
    if (this.unanswered.some((m) => m.size > 0)) {
      const attempt = heldLockId(owner, key, mode);
      inflated = this.unanswered.map((m) => m.get(attempt) ?? 0);
    }
    const calls = this.nodes.map((n) => n.store.acquire({ ...request, fair: false, holdsHere: nodeHolds }));
    const answers = await gather(calls, nodeTimeout(leaseMs, this.stepTimeoutMs), (got, pending) => {
      const granted = got.filter((a) => a?.ok && a.value.granted).length;
      if (granted >= this.quorum) return true;
      if (granted + pending >= this.quorum) return false;
      // It cannot be granted any more; wait only where the others decide contended or unreachable.
      return pending === 0 || granted + got.filter((a) => a?.ok && !a.value.granted).length >= this.quorum;
    });
    const validity = leaseMs - (now() - start) - this.driftMs(leaseMs);
    const grants = answers.flatMap((a) => (a?.ok && a.value.granted ? [a.value] : []));
    if (grants.length >= this.quorum && validity > 0) {
      // A node restarted empty re-grants a re-entry as fresh: the largest hold count is ours. Nodes
      // that have not answered yet hold the lock for us too if they grant it, unless the caller
      // holds nothing of it by then: a node that did not know the script answered NOSCRIPT, and the
      // acquisition went again with the script's text behind the release sent to it meanwhile, so
      // it granted a lock already given back. That grant is given back too. The caller's holds are
      // counted on the next turn of the event loop, once the caller has recorded this grant (a late
      // answer may come in the same read as the deciding one).
      //
      // A node that refused a write lock (a reader holds it there) keeps the writer as waiting, and
      // a waiting writer keeps new readers out of that node until its place lapses: the writer,
      // which holds the lock now, leaves every such node, now or when it answers.
      counted = true;
      calls.forEach((call, i) => {
        const a = answers[i];
        if (a?.ok) {
          if (!a.value.granted && mode === 'write') this.leaveWriters(i, key, owner);
          return;
        }
        // Not answered yet (or given up on): act on the answer when it comes.
        const countHolds = a === undefined ? holdsHere : undefined;
        if (!countHolds && mode !== 'write') return;
        void call
          .then(async (late) => {
            if (!late.granted) {
              if (mode === 'write') this.leaveWriters(i, key, owner);
              return;
            }
            if (!countHolds) return;
            await nextTurn();
            const holds = countHolds(owner, key, mode);
            if (holds === 0) await this.nodes[i]!.store.releaseAll(key, owner, mode);
            // More holds there than this process has: the node ran a release of an inner hold
            // before that hold's grant (the grant went again behind it), which took nothing then.
            else if (holds !== undefined && late.holdCount > holds) await this.nodes[i]!.store.trimHolds(key, owner, mode, late.holdCount, holds);
          })
          .catch(() => undefined);
      });
      // Each node's count without the holds of failed attempts it may have granted before this one.
      const counts = answers.flatMap((a, i) => (a?.ok && a.value.granted ? [Math.max(1, a.value.holdCount - (inflated?.[i] ?? 0))] : []));
      return { granted: true, holdCount: Math.max(...counts), fencingToken: Number.NaN };
    }
    // Not granted: give back every hold this attempt took, now or when a late node answers.
    await Promise.all(
      calls.map((call, i) => {
        const a = answers[i];
        if (a?.ok) return a.value.granted ? this.nodes[i]!.store.release(key, owner, mode).catch(() => undefined) : undefined;
        this.unsettled(i, heldLockId(owner, key, mode), call);
        void call.then((late) => (late.granted ? this.nodes[i]!.store.release(key, owner, mode) : undefined)).catch(() => undefined);
        return undefined;
      }),
    );
    const refusals = answers.flatMap((a) => (a?.ok && !a.value.granted ? [a.value] : []));
    if (refusals.some((r) => r.upgrade)) return { granted: false, ttlMs: -1, upgrade: true };
    if (grants.length + refusals.length < this.quorum) throw this.quorumError('acquire', key, answers.map((a) => (a?.ok ? { ok: true, value: a.value.granted } : a)));
    // Held elsewhere: retry at the latest when the holder's longest lease ends (a release wakes us sooner).
    // A quorum that granted too late to be valid: retry at once.
    if (grants.length >= this.quorum) return { granted: false, ttlMs: 0 };
    return { granted: false, ttlMs: Math.max(-1, ...refusals.map((r) => r.ttlMs)) };
  }

  /** A writer that holds the lock leaves node `i`'s waiting writers, where that node refused it. */
  private leaveWriters(i: number, key: string, owner: string): void {
    void this.nodes[i]!.store.abandon(key, owner, 'write', false).catch(() => undefined);
  }

  /**
   * Node `i` has not answered a failed attempt (`call`) of an owner on a lock yet. Should it grant
   * it, the hold is given back when its answer comes, so after any attempt of the same owner on
   * the same lock sent meanwhile: that one is a re-entry of the failed attempt's grant on that
   * node, with a hold count one too high. Until the node answers, attempts sent to it take one
   * hold off that node's count for each failed attempt it has not answered.
   */
  private unsettled(i: number, attempt: string, call: Promise<unknown>): void {
    const counts = this.unanswered[i]!;
    counts.set(attempt, (counts.get(attempt) ?? 0) + 1);
    const answered = () => {
      const left = counts.get(attempt)! - 1;
      if (left > 0) counts.set(attempt, left);
      else counts.delete(attempt);
    };
    void call.then(answered, answered);
  }

  async release(key: string, owner: string, mode?: LockMode, _takeAlong?: TakeAlong, holdsHere?: HoldsHere, stillHeld?: boolean): Promise<number> {
    const answers = await this.everyNode((s) => s.release(key, owner, mode, undefined, holdsHere, stillHeld), this.stepTimeoutMs, 'release', key);
    return Math.max(-1, ...answers.flatMap((a) => (a?.ok ? [a.value] : [])));
  }

  async releaseAll(key: string, owner: string, mode?: LockMode): Promise<boolean> {
    const answers = await this.everyNode((s) => s.releaseAll(key, owner, mode), this.stepTimeoutMs, 'release', key);
    return answers.some((a) => a?.ok && a.value);
  }

  async renew(entries: readonly RenewRequest[]): Promise<boolean[]> {
    const timeoutMs = nodeTimeout(Math.min(...entries.map((e) => e.leaseMs)), this.stepTimeoutMs);
    // Per lock: true (a quorum renewed it), false (a majority said no), undefined (not decided yet).
    const decide = (got: readonly (Answer<boolean[]> | undefined)[]) =>
      entries.map((_, i) => {
        const yes = got.filter((a) => a?.ok && a.value[i]).length;
        const no = got.filter((a) => a?.ok && !a.value[i]).length;
        return yes >= this.quorum ? true : this.nodes.length - no < this.quorum ? false : undefined;
      });
    const answers = await gather(
      this.nodes.map((n) => n.store.renew(entries)),
      timeoutMs,
      (got, pending) => pending === 0 || decide(got).every((r) => r !== undefined),
    );
    const results = decide(answers);
    // Too few answers to tell: the watchdog retries until the lock's local deadline.
    if (results.some((r) => r === undefined)) {
      throw this.quorumError('renewal', entries.length === 1 ? entries[0]!.key : `${entries.length} locks`, answers.map((a) => (a?.ok ? { ok: true, value: true } : a)));
    }
    return results as boolean[];
  }

  async inspect(key: string, owner: string | undefined, mode?: LockMode): Promise<LockState> {
    const answers = await this.everyNode((s) => s.inspect(key, owner, mode), this.stepTimeoutMs, 'inspect', key, (got) => {
      // Decided once a quorum says locked, or too many say free for a quorum to be left.
      const locked = got.filter((a) => a?.ok && a.value.locked).length;
      const free = got.filter((a) => a?.ok && !a.value.locked).length;
      return locked >= this.quorum || this.nodes.length - free < this.quorum;
    });
    const states = answers.flatMap((a) => (a?.ok ? [a.value] : []));
    const locked = states.filter((s) => s.locked);
    if (locked.length < this.quorum) return { locked: false, holdCount: 0, ttlMs: -2 };
    // Held until fewer than a quorum of its leases remain.
    const ttls = locked.map((s) => s.ttlMs).sort((a, b) => b - a);
    return { locked: true, holdCount: Math.max(...locked.map((s) => s.holdCount)), ttlMs: ttls[this.quorum - 1]! };
  }

  async forceUnlock(key: string): Promise<boolean> {
    const answers = await this.everyNode((s) => s.forceUnlock(key), this.stepTimeoutMs, 'forceUnlock', key);
    return answers.some((a) => a?.ok && a.value);
  }

  async abandon(key: string, owner: string, mode: LockMode): Promise<void> {
    await this.everyNode((s) => s.abandon(key, owner, mode, false), this.stepTimeoutMs, 'abandon', key).catch(() => undefined);
  }

  /**
   * Releases are announced on every node; a waiter listens on the first node that confirms its
   * subscription (see FirstReadyWatch), so a node that is down or frozen when the wait starts delays
   * nobody. A release it misses (that node fails later) costs at most the holder's remaining lease,
   * which the attempt reported.
   */
  watch(key: string, owner: string): ReleaseWatch {
    return new FirstReadyWatch(this.nodes.map((n) => n.store.watch(key, owner)));
  }

  async close(): Promise<void> {
    await Promise.all(this.nodes.map((n) => n.store.close()));
  }

  /** The clock drift allowance for a lease: lease × driftFactor + 2 ms (the Redlock paper's margin). */
  driftMs(leaseMs: number): number {
    return Math.ceil(leaseMs * this.driftFactor) + 2;
  }

  /**
   * Runs a step on every node; returns once a quorum of nodes answered (or `decided` says the
   * answers so far settle it), else once every node answered or timed out. Fails with
   * LockQuorumError only when no node answered.
   */
  private async everyNode<T>(
    step: (store: RedisLockStore) => Promise<T>,
    timeoutMs: number,
    operation: string,
    key: string,
    decided: (got: readonly (Answer<T> | undefined)[]) => boolean = (got) => got.filter((a) => a?.ok).length >= this.quorum,
  ): Promise<(Answer<T> | undefined)[]> {
    const answers = await gather(this.nodes.map((n) => step(n.store)), timeoutMs, (got, pending) => pending === 0 || decided(got));
    if (answers.every((a) => !a?.ok)) throw this.quorumError(operation, key, answers);
    return answers;
  }

  private quorumError(operation: string, key: string, answers: readonly (Answer<unknown> | undefined)[]): LockQuorumError {
    const votes: RedlockVote[] = this.nodes.map((n, i) => {
      const a = answers[i];
      if (!a) return { node: n.name, vote: 'error', error: 'no answer' };
      if (!a.ok) return { node: n.name, vote: 'error', error: a.error };
      return { node: n.name, vote: a.value === false ? 'held' : 'granted' };
    });
    return new LockQuorumError(key, operation, votes, this.quorum);
  }
}

/**
 * One waiter's watch of a key on the first node that confirms it: the waiter subscribes on every
 * node, keeps the first whose subscription is confirmed, and leaves the others (a node that is down
 * or frozen confirms nothing, and one whose subscription failed does not count, so neither is the
 * one a waiter depends on). Until one confirms, and should none ever do, the first node's watch is
 * used: a missed release then costs the holder's remaining lease, as on any node. Fair mode, which
 * relies on wait ids and grants, is refused on Redlock.
 *
 * @internal Exported for its test only.
 */
export class FirstReadyWatch implements ReleaseWatch {
  readonly ready: Promise<void>;
  readonly listening: Promise<boolean>;
  private chosen: ReleaseWatch;
  private closed = false;

  constructor(private readonly watches: readonly ReleaseWatch[]) {
    this.chosen = watches[0]!;
    // The first watch that listens; a node whose subscription failed is passed over (its failure
    // can come back before the others' confirmations). Undefined once every one failed.
    const first = new Promise<ReleaseWatch | undefined>((resolve) => {
      let failed = 0;
      for (const w of watches) {
        void w.listening.then((ok) => {
          if (ok) resolve(w);
          else if (++failed === watches.length) resolve(undefined);
        });
      }
    });
    this.listening = first.then((w) => w !== undefined);
    this.ready = first.then((w) => {
      if (w) this.chosen = w;
      for (const other of watches) if (other !== this.chosen) other.close();
    });
  }

  get waitId(): string {
    return this.chosen.waitId;
  }

  sleep(timeoutMs: number, signal?: AbortSignal): Promise<'released' | 'timeout' | 'aborted' | 'granted'> {
    return this.chosen.sleep(timeoutMs, signal);
  }

  forgetGrant(lastToken?: number): void {
    this.chosen.forgetGrant(lastToken);
  }

  close(passWake?: boolean): void {
    if (this.closed) return;
    this.closed = true;
    // Closing a watch twice does nothing, so the ones left when the first confirmed may be closed again.
    for (const w of this.watches) w.close(w === this.chosen && passWake);
  }
}

/**
 * Runs `calls` (one per node) and resolves with the answers so far as soon as `decided(answers,
 * pending)` is true; it is asked after every answer, and is true at the latest when none is
 * pending. A node that does not answer within `timeoutMs` counts as an error answer. A node still
 * pending at the decision is left `undefined`; its call goes on, and its late outcome is the
 * caller's to handle (its rejection is caught here).
 */
function gather<T>(
  calls: readonly Promise<T>[],
  timeoutMs: number,
  decided: (answers: readonly (Answer<T> | undefined)[], pending: number) => boolean,
): Promise<(Answer<T> | undefined)[]> {
  const answers: (Answer<T> | undefined)[] = new Array(calls.length).fill(undefined);
  let pending = calls.length;
  return new Promise((resolve) => {
    let done = false;
    calls.forEach((call, i) => {
      void settle(call, timeoutMs).then((answer) => {
        if (done) return;
        answers[i] = answer;
        pending--;
        if (decided(answers, pending)) {
          done = true;
          resolve([...answers]);
        }
      });
    });
  });
}

function settle<T>(promise: Promise<T>, timeoutMs: number): Promise<Answer<T>> {
  return withTimeout(promise, timeoutMs, () => new Error(`no answer within ${timeoutMs} ms`)).then(
    (value) => ({ ok: true as const, value }),
    (e: unknown) => ({ ok: false as const, error: message(e) }),
  );
}

function message(e: unknown): string {
  return e instanceof Error ? e.message : String(e);
}
