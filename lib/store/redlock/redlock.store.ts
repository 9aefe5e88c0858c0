import type { AcquireRequest, AcquireResult, LockMode, LockState, LockStore, ReleaseWatch, RenewRequest } from '../lock-store.js';
import type { RedisLockStore } from '../redis/redis-lock.store.js';
import { LockQuorumError, type RedlockVote } from '../../errors/lock-quorum.error.js';
import { now, withTimeout } from '../../internal/time.js';

/** One Redlock node: an independent master with its own store (scripts, release channel). */
export interface RedlockNode {
  /** `host:port`, for messages and votes. */
  name: string;
  store: RedisLockStore;
  /** Whether its connection is up right now (a watch is placed on a node that is). */
  connected(): boolean;
}

type Answer<T> = { ok: true; value: T } | { ok: false; error: string };

/** Per-node timeout of one step: a tenth of the lease, from 50 ms to 1 s (a down node must not eat the validity). */
const nodeTimeout = (leaseMs: number) => Math.min(Math.max(Math.floor(leaseMs / 10), 50), 1_000);
/** Steps without a lease (inspect, release, force-unlock) wait for a node this long. */
const STEP_TIMEOUT_MS = 1_000;

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
 * Fencing tokens are not issued: counters on independent masters cannot be made monotonic
 * together (a token is NaN, and `LockHandle.fencingToken` throws). Fair mode is refused.
 */
export class RedlockStore implements LockStore {
  readonly description: string;
  readonly quorum: number;
  readonly supportsFairMode = false;

  constructor(
    private readonly nodes: readonly RedlockNode[],
    readonly driftFactor: number,
  ) {
    this.quorum = Math.floor(nodes.length / 2) + 1;
    this.description = `redlock over ${nodes.map((n) => n.name).join(', ')}`;
  }

  /** Ready once a quorum of nodes answered and loaded the scripts; the others join when they come up. */
  async ready(timeoutMs: number): Promise<void> {
    const answers: Answer<void>[] = new Array(this.nodes.length);
    let ok = 0;
    let settled = 0;
    await new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => reject(this.quorumError('bootstrap', '', answers)), timeoutMs);
      timer.unref();
      this.nodes.forEach((node, i) => {
        node.store.ready(timeoutMs).then(
          () => {
            answers[i] = { ok: true, value: undefined };
            if (++ok === this.quorum) {
              clearTimeout(timer);
              resolve();
            }
          },
          (e: unknown) => {
            answers[i] = { ok: false, error: message(e) };
          },
        ).finally(() => {
          if (++settled === this.nodes.length && ok < this.quorum) {
            clearTimeout(timer);
            reject(this.quorumError('bootstrap', '', answers));
          }
        });
      });
    });
  }

  async acquire(request: AcquireRequest): Promise<AcquireResult> {
    const { key, owner, leaseMs, mode = 'exclusive' } = request;
    const start = now();
    const timeoutMs = nodeTimeout(leaseMs);
    const calls = this.nodes.map((n) => n.store.acquire({ ...request, fair: false }));
    const answers = await Promise.all(calls.map((call) => settle(call, timeoutMs)));
    const validity = leaseMs - (now() - start) - this.driftMs(leaseMs);
    const grants = answers.flatMap((a) => (a.ok && a.value.granted ? [a.value] : []));
    if (grants.length >= this.quorum && validity > 0) {
      // A node restarted empty re-grants a re-entry as fresh: the largest hold count is ours.
      return { granted: true, holdCount: Math.max(...grants.map((g) => g.holdCount)), fencingToken: Number.NaN };
    }
    // Not granted: give back every hold this attempt took, now or when a late node answers.
    await Promise.all(
      calls.map((call, i) => {
        const a = answers[i]!;
        if (a.ok) return a.value.granted ? this.nodes[i]!.store.release(key, owner, mode).catch(() => undefined) : undefined;
        void call.then((late) => (late.granted ? this.nodes[i]!.store.release(key, owner, mode) : undefined)).catch(() => undefined);
        return undefined;
      }),
    );
    const refusals = answers.flatMap((a) => (a.ok && !a.value.granted ? [a.value] : []));
    if (refusals.some((r) => r.upgrade)) return { granted: false, ttlMs: -1, upgrade: true };
    if (grants.length + refusals.length < this.quorum) throw this.quorumError('acquire', key, answers.map((a) => (a.ok ? { ok: true, value: a.value.granted } : a)));
    // Held elsewhere: retry at the latest when the holder's longest lease ends (a release wakes us sooner).
    // A quorum that granted too late to be valid: retry at once.
    if (grants.length >= this.quorum) return { granted: false, ttlMs: 0 };
    return { granted: false, ttlMs: Math.max(-1, ...refusals.map((r) => r.ttlMs)) };
  }

  async release(key: string, owner: string, mode?: LockMode): Promise<number> {
    const answers = await this.everyNode((s) => s.release(key, owner, mode), STEP_TIMEOUT_MS, 'release', key);
    return Math.max(-1, ...answers.flatMap((a) => (a.ok ? [a.value] : [])));
  }

  async releaseAll(key: string, owner: string, mode?: LockMode): Promise<boolean> {
    const answers = await this.everyNode((s) => s.releaseAll(key, owner, mode), STEP_TIMEOUT_MS, 'release', key);
    return answers.some((a) => a.ok && a.value);
  }

  async renew(entries: readonly RenewRequest[]): Promise<boolean[]> {
    const timeoutMs = nodeTimeout(Math.min(...entries.map((e) => e.leaseMs)));
    const answers = await Promise.all(this.nodes.map((n) => settle(n.store.renew(entries), timeoutMs)));
    const results: boolean[] = [];
    let undetermined = false;
    entries.forEach((_, i) => {
      const yes = answers.filter((a) => a.ok && a.value[i]).length;
      const no = answers.filter((a) => a.ok && !a.value[i]).length;
      if (yes >= this.quorum) results.push(true);
      else if (this.nodes.length - no < this.quorum) results.push(false);
      else undetermined = true;
    });
    // Too few answers to tell: the watchdog retries until the lock's local deadline.
    if (undetermined) throw this.quorumError('renewal', entries.length === 1 ? entries[0]!.key : `${entries.length} locks`, answers.map((a) => (a.ok ? { ok: true, value: true } : a)));
    return results;
  }

  async inspect(key: string, owner: string | undefined, mode?: LockMode): Promise<LockState> {
    const answers = await this.everyNode((s) => s.inspect(key, owner, mode), STEP_TIMEOUT_MS, 'inspect', key);
    const states = answers.flatMap((a) => (a.ok ? [a.value] : []));
    const locked = states.filter((s) => s.locked);
    if (locked.length < this.quorum) return { locked: false, holdCount: 0, ttlMs: -2 };
    // Held until fewer than a quorum of its leases remain.
    const ttls = locked.map((s) => s.ttlMs).sort((a, b) => b - a);
    return { locked: true, holdCount: Math.max(...locked.map((s) => s.holdCount)), ttlMs: ttls[this.quorum - 1]! };
  }

  async forceUnlock(key: string): Promise<boolean> {
    const answers = await this.everyNode((s) => s.forceUnlock(key), STEP_TIMEOUT_MS, 'forceUnlock', key);
    return answers.some((a) => a.ok && a.value);
  }

  async abandon(key: string, owner: string, mode: LockMode): Promise<void> {
    await this.everyNode((s) => s.abandon(key, owner, mode, false), STEP_TIMEOUT_MS, 'abandon', key).catch(() => undefined);
  }

  /**
   * Releases are announced on every node; a waiter listens on one node that is up (a release it
   * misses costs at most the holder's remaining lease, which the attempt reported).
   */
  watch(key: string, owner: string): ReleaseWatch {
    const node = this.nodes.find((n) => n.connected()) ?? this.nodes[0]!;
    return node.store.watch(key, owner);
  }

  async close(): Promise<void> {
    await Promise.all(this.nodes.map((n) => n.store.close()));
  }

  /** The clock drift allowance for a lease: lease × driftFactor + 2 ms (the Redlock paper's margin). */
  driftMs(leaseMs: number): number {
    return Math.ceil(leaseMs * this.driftFactor) + 2;
  }

  /** Runs a step on every node; fails with LockQuorumError only when no node answered. */
  private async everyNode<T>(step: (store: RedisLockStore) => Promise<T>, timeoutMs: number, operation: string, key: string): Promise<Answer<T>[]> {
    const answers = await Promise.all(this.nodes.map((n) => settle(step(n.store), timeoutMs)));
    if (answers.every((a) => !a.ok)) throw this.quorumError(operation, key, answers);
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

function settle<T>(promise: Promise<T>, timeoutMs: number): Promise<Answer<T>> {
  return withTimeout(promise, timeoutMs, () => new Error(`no answer within ${timeoutMs} ms`)).then(
    (value) => ({ ok: true as const, value }),
    (e: unknown) => ({ ok: false as const, error: message(e) }),
  );
}

function message(e: unknown): string {
  return e instanceof Error ? e.message : String(e);
}
