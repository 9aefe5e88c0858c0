import { performance } from 'node:perf_hooks';
import { globalTime } from '../../internal/time.js';
import { ReleaseWaiters } from '../../waiting/release-waiters.js';
import type { AcquireManyResult, AcquireRequest, AcquireResult, LockMode, LockState, LockStore, ReleaseWatch, RenewRequest } from '../lock-store.js';
import { DEFAULT_FAIR_QUEUE_TIMEOUT_MS } from '../../lock.constants.js';

/**
 * Locks in this process's memory, with the semantics of the Redis store (`lock.scripts.ts`):
 * owner -> holds per lock, leases, re-entry that never shortens a lease, fencing tokens, the fair
 * queue, read-write locks with writer priority, multi-key groups, release announcements.
 *
 * For tests and single-process apps only: it protects nothing across processes. Leases run on
 * this process's monotonic clock and expire lazily (when the lock is next looked at); waiters are
 * woken by releases and, for expiries, by their own lease-bounded sleeps, as with Redis (and the
 * head of a fair queue by a newcomer's attempt on the lapsed lock, where Redis hands it over).
 */
export class MemoryLockStore implements LockStore {
  readonly description = 'in-process memory store (not distributed)';
  /** Every step answers at once: nothing to bound. */
  readonly boundsSteps = true;
  /** Leases live in this process: a test's fake timers move them, and the timers that wait for them (see LockStore.time). */
  readonly time = globalTime;
  private readonly locks = new Map<string, MemoryLock>();
  private readonly fences = new Map<string, { last: number; expiresAt: number }>();
  private readonly queues = new Map<string, Map<string, number>>(); // fair: owner -> place deadline, in order
  private readonly writers = new Map<string, Map<string, number>>(); // waiting writers -> place deadline
  private readonly waiters = new ReleaseWaiters(globalTime);

  async ready(): Promise<void> {}

  async close(): Promise<void> {}

  async acquire({ key, owner, leaseMs, mode = 'exclusive', fair, queueTimeoutMs = DEFAULT_FAIR_QUEUE_TIMEOUT_MS }: AcquireRequest): Promise<AcquireResult> {
    const lock = this.live(key);
    const field = holderField(owner, mode);
    if (lock?.fields.has(field)) return this.reenter(key, lock, field, leaseMs);
    const t = clock();
    if (mode === 'read') {
      const downgrade = lock !== undefined && lock.mode !== 'read' && lock.fields.has(owner);
      if (lock && lock.mode !== 'read' && !downgrade) return { granted: false, ttlMs: lock.ttl() };
      const live = this.prune(this.writers, key, t);
      if (live && live.size > 0 && !downgrade) {
        return { granted: false, ttlMs: lock ? lock.ttl() : Math.max(1, Math.min(...live.values()) - t) };
      }
      const target = lock ?? this.create(key, 'read');
      target.fields.set(field, 1);
      target.extendTo(leaseMs);
      return { granted: true, holdCount: 1, fencingToken: this.token(key) };
    }
    if (mode === 'write') {
      if (!lock) {
        this.writers.get(key)?.delete(owner);
        return this.grant(key, owner, leaseMs);
      }
      if (lock.fields.has(`${owner}:read`)) return { granted: false, ttlMs: -1, upgrade: true };
      this.prune(this.writers, key, t);
      const writers = this.writers.get(key) ?? new Map<string, number>();
      writers.set(owner, t + queueTimeoutMs);
      this.writers.set(key, writers);
      return { granted: false, ttlMs: lock.ttl() };
    }
    if (!fair) return lock ? { granted: false, ttlMs: lock.ttl() } : this.grant(key, owner, leaseMs);
    const queue = this.prune(this.queues, key, t) ?? new Map<string, number>();
    const head = queue.keys().next().value;
    if (!lock && (head === undefined || head === owner)) {
      queue.delete(owner);
      return this.grant(key, owner, leaseMs);
    }
    queue.set(owner, t + queueTimeoutMs); // a new owner joins at the end; a known one keeps its place
    this.queues.set(key, queue);
    if (lock) return { granted: false, ttlMs: lock.ttl() };
    // Free (its lease ran out) with another owner at the head: wake the head to take it, as the
    // Redis script hands it over on this attempt.
    this.waiters.notifyOwner(key, head!);
    return { granted: false, ttlMs: Math.max(0, queue.get(head!)! - t) };
  }

  async acquireMany(keys: readonly string[], owner: string, leaseMs: number): Promise<AcquireManyResult> {
    for (const key of keys) {
      const lock = this.live(key);
      if (lock && !lock.fields.has(owner)) return { granted: false, blockedBy: key, ttlMs: lock.ttl() };
    }
    const grants = keys.map((key) => {
      const lock = this.live(key);
      const r = (lock ? this.reenter(key, lock, owner, leaseMs) : this.grant(key, owner, leaseMs)) as AcquireResult & { granted: true };
      return { holdCount: r.holdCount, fencingToken: r.fencingToken };
    });
    return { granted: true, grants };
  }

  async release(key: string, owner: string, mode: LockMode = 'exclusive'): Promise<number> {
    const lock = this.live(key);
    const field = holderField(owner, mode);
    const holds = lock?.fields.get(field);
    if (!lock || holds === undefined) return -1;
    if (holds > 1) {
      lock.fields.set(field, holds - 1);
      return holds - 1;
    }
    lock.fields.delete(field);
    this.fieldGone(key, lock, mode);
    return 0;
  }

  async releaseAll(key: string, owner: string, mode: LockMode = 'exclusive'): Promise<boolean> {
    const lock = this.live(key);
    if (!lock?.fields.delete(holderField(owner, mode))) return false;
    this.fieldGone(key, lock, mode);
    return true;
  }

  async renew(entries: readonly RenewRequest[]): Promise<boolean[]> {
    return entries.map(({ key, owner, leaseMs, mode = 'exclusive', exact, holdsAtMost }) => {
      const lock = this.live(key);
      const holds = lock?.fields.get(holderField(owner, mode));
      if (!lock || holds === undefined) return false;
      // Other holders count on the lease as it is: only a holder alone, with no more holds than the
      // caller's, sets it shorter, and wakes every waiter to learn it (see SET_LEASE).
      const at = clock() + leaseMs;
      if (exact && lock.fields.size === 1 && (holdsAtMost === undefined || holds <= holdsAtMost) && at < lock.expiresAt) {
        lock.expiresAt = at;
        this.waiters.notifyEveryone(key);
      } else lock.extendTo(leaseMs);
      return true;
    });
  }

  async inspect(key: string, owner: string | undefined, mode: LockMode = 'exclusive'): Promise<LockState> {
    const lock = this.live(key);
    if (!lock) return { locked: false, holdCount: 0, ttlMs: -2 };
    return { locked: true, holdCount: owner === undefined ? 0 : lock.fields.get(holderField(owner, mode)) ?? 0, ttlMs: lock.ttl() };
  }

  async forceUnlock(key: string): Promise<boolean> {
    if (!this.live(key)) return false;
    this.free(key, 'all'); // as the script: it may be a write lock with readers waiting
    return true;
  }

  async abandon(key: string, owner: string, mode: LockMode, fair: boolean): Promise<void> {
    if (fair) {
      const queue = this.queues.get(key);
      const wasHead = queue?.keys().next().value === owner;
      if (queue?.delete(owner) && wasHead && !this.live(key)) {
        const head = queue.keys().next().value;
        if (head !== undefined) this.waiters.notifyOwner(key, head);
      }
      if (queue?.size === 0) this.queues.delete(key);
    }
    // Readers that the place kept out try again now (as the Redis store's LEAVE_WRITERS announces).
    if (mode === 'write' && this.writers.get(key)?.delete(owner)) {
      const lock = this.live(key);
      if (!lock || lock.mode === 'read') this.waiters.notifyEveryone(key);
    }
  }

  watch(key: string, owner: string): ReleaseWatch {
    return this.waiters.join(key, owner, Promise.resolve(true));
  }

  /** Held locks and queued waiters, for tests. */
  get waitState(): { channels: number; waiters: number } {
    return { channels: this.waiters.keys().length, waiters: this.waiters.size };
  }

  private live(key: string): MemoryLock | undefined {
    const lock = this.locks.get(key);
    if (lock && lock.expiresAt <= clock()) {
      this.locks.delete(key); // expired: gone, as a Redis key whose PEXPIRE passed
      return undefined;
    }
    return lock;
  }

  private create(key: string, mode?: 'read'): MemoryLock {
    const lock = new MemoryLock(mode);
    this.locks.set(key, lock);
    return lock;
  }

  private grant(key: string, owner: string, leaseMs: number): AcquireResult {
    const lock = this.create(key);
    lock.fields.set(owner, 1);
    lock.expiresAt = clock() + leaseMs;
    return { granted: true, holdCount: 1, fencingToken: this.token(key) };
  }

  private reenter(key: string, lock: MemoryLock, field: string, leaseMs: number): AcquireResult {
    const holds = lock.fields.get(field)! + 1;
    lock.fields.set(field, holds);
    lock.extendTo(leaseMs);
    return { granted: true, holdCount: holds, fencingToken: this.fences.get(key)?.last ?? 0 };
  }

  /** max(last + 1, wall clock in microseconds), like the scripts; the counter is forgotten after an hour unused. */
  private token(key: string): number {
    const t = clock();
    const fence = this.fences.get(key);
    const last = fence && fence.expiresAt > t ? fence.last : 0;
    const token = Math.max(last + 1, Math.floor((performance.timeOrigin + performance.now()) * 1000));
    this.fences.set(key, { last: token, expiresAt: t + 3_600_000 });
    return token;
  }

  /**
   * The holder field of `mode` has just left `lock` (its last hold released, or all its holds): free
   * the lock when nothing is left, or, when a writer leaves only its own read holds, make it a read
   * lock. Read-write changes wake every waiter, as the scripts announce `all`.
   */
  private fieldGone(key: string, lock: MemoryLock, mode: LockMode): void {
    if (mode === 'exclusive') {
      if (lock.fields.size === 0) this.free(key, 'one');
    } else if (lock.fields.size === 0) {
      this.free(key, 'all');
    } else if (lock.mode !== 'read' && mode === 'write') {
      lock.mode = 'read'; // the writer left; only its own read holds remain
      this.waiters.notifyEveryone(key);
    }
  }

  /** The lock is free: announce it (the fair queue's head if there is one, else one or all waiters). */
  private free(key: string, wake: 'one' | 'all'): void {
    this.locks.delete(key);
    const head = this.prune(this.queues, key, clock())?.keys().next().value;
    if (head !== undefined) this.waiters.notifyOwner(key, head);
    else if (wake === 'all') this.waiters.notifyEveryone(key);
    else this.waiters.notify(key);
  }

  /** Drops places whose deadline passed; returns what is left. */
  private prune(places: Map<string, Map<string, number>>, key: string, t: number): Map<string, number> | undefined {
    const entries = places.get(key);
    if (!entries) return undefined;
    for (const [owner, deadline] of entries) if (deadline <= t) entries.delete(owner);
    if (entries.size === 0) {
      places.delete(key);
      return undefined;
    }
    return entries;
  }
}

class MemoryLock {
  readonly fields = new Map<string, number>();
  expiresAt = 0;

  constructor(public mode?: 'read') {}

  ttl(): number {
    return Math.max(0, Math.ceil(this.expiresAt - clock()));
  }

  /** A lease that never shortens: max(remaining, leaseMs). */
  extendTo(leaseMs: number): void {
    this.expiresAt = Math.max(this.expiresAt, clock() + leaseMs);
  }
}

/** The clock of the memory store's leases and queue places (see LockStore.time). */
const clock = globalTime.now;

function holderField(owner: string, mode: LockMode): string {
  return mode === 'read' ? `${owner}:read` : owner;
}
