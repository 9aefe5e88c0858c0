import type { HeldLock } from '../held-lock.js';
import { realTime, type Time, type Timer } from '../internal/time.js';

/**
 * How close to its deadline a lock counts as lost, and how early the timer is set for it. Node runs
 * timers on a loop time kept in whole milliseconds, so one fires up to a millisecond off; the
 * margin between a holder's deadline (its lease counted from when it sent the acquisition) and the
 * moment Redis frees the lock (its lease counted from when it ran it) can be less than that. A
 * timer a millisecond late told the holder after another owner had the lock (seen once in a full
 * run: renewal.spec, a partition between the holder and Redis).
 */
export const DEADLINE_SLACK_MS = 1;

/** When the watchdog counts `lock` lost: DEADLINE_SLACK_MS before its deadline. */
const lostAt = (lock: HeldLock): number => lock.deadline - DEADLINE_SLACK_MS;

/** What the watchdog asks of the service that owns it. Each hook must not throw. */
export interface WatchdogHooks {
  /** Renew these locks in the backend; one boolean per lock (false: no longer ours). */
  renew(locks: readonly HeldLock[]): Promise<boolean[]>;
  /** Locks of different groups are renewed in separate calls that succeed or fail on their own (see `LockStore.renewalGroup`). */
  group(lock: HeldLock): number;
  renewed(locks: readonly HeldLock[]): void;
  /** A lock passed its deadline (`lease-expired`) or the backend no longer lists its owner (`taken`). */
  lost(lock: HeldLock, reason: 'lease-expired' | 'taken'): void;
  /** A renewal call failed; the locks will be retried until their deadlines. */
  renewFailed(locks: readonly HeldLock[], error: unknown): void;
  /**
   * A renewal call has had no answer for `unansweredAfterMs` (Redis frozen, or cut off with no
   * reset); these locks are still watched. The call is still waited for, until their deadlines.
   */
  renewUnanswered(locks: readonly HeldLock[], afterMs: number): void;
}

/**
 * Keeps held locks alive with ONE timer per LockService, never one per lock. The timer fires at
 * the earliest moment something is due: a renewal (every third of a lease) or a deadline (the end
 * of the last lease we know Redis granted). Every lock due within half a renewal period is renewed
 * in the same batch, so N locks cost about N / 500 script calls per period on one Redis. A batch
 * is split by the store's renewal group (the slot on a Redis Cluster): each group's renewal
 * succeeds or fails on its own, so a master that is down costs only the locks it serves.
 *
 * A failed renewal is retried (every tenth of the lease, at most every second) until the lock's
 * deadline passes on the monotonic clock; then the lock is lost. A renewal with no answer after
 * `unansweredAfterMs` is reported (renewUnanswered) and still waited for, not sent again: its
 * answer, should it come within the lease, renews the lock. A fixed-lease lock is never renewed,
 * only watched for its deadline.
 */
export class Watchdog {
  private readonly locks = new Set<HeldLock>();
  private timer: Timer | undefined;
  private wakeAt = Infinity;
  private stopped = false;

  constructor(
    private readonly hooks: WatchdogHooks,
    /** The clock of the locks' deadlines and the timer that waits for them (LockStore.time). */
    private readonly time: Time = realTime,
    /** When a renewal with no answer yet is reported; undefined: a store that bounds its own steps (Redlock's renewals fail in time). */
    private readonly unansweredAfterMs?: number,
  ) {}

  get size(): number {
    return this.locks.size;
  }

  /** How late the most overdue renewal is, in ms (0 when every renewal is on time). */
  overdueMs(): number {
    const t = this.time.now();
    let worst = 0;
    for (const lock of this.locks) if (lock.watchdog) worst = Math.max(worst, t - lock.renewAt);
    return worst;
  }

  add(lock: HeldLock): void {
    if (this.stopped) return;
    this.locks.add(lock);
    this.schedule(Math.min(lock.renewAt, lostAt(lock)));
  }

  /** A lock's lease or deadline changed (re-entry, extend). */
  touch(lock: HeldLock): void {
    if (this.locks.has(lock)) this.schedule(Math.min(lock.renewAt, lostAt(lock)));
  }

  /**
   * Stops watching a lock. Called before its release is sent, so no renewal can follow a release.
   * The timer stays armed when the last lock goes (it never keeps the process alive, and a tick
   * with nothing due only reschedules): a service that takes and releases one lock at a time would
   * otherwise clear and arm a timer on every acquisition.
   */
  remove(lock: HeldLock): void {
    this.locks.delete(lock);
  }

  stop(): void {
    this.stopped = true;
    this.locks.clear();
    this.clear();
  }

  private clear(): void {
    if (this.timer) this.time.clearTimeout(this.timer);
    this.timer = undefined;
    this.wakeAt = Infinity;
  }

  private schedule(at: number): void {
    if (this.stopped || at >= this.wakeAt) return;
    if (this.timer) this.time.clearTimeout(this.timer);
    this.wakeAt = at;
    this.timer = this.time.setTimeout(() => this.tick(), Math.max(0, Math.ceil(at - this.time.now())));
    // A held lock alone never keeps the process alive; its lease frees it if the process exits.
    this.timer.unref();
  }

  private tick(): void {
    this.timer = undefined;
    this.wakeAt = Infinity;
    const t = this.time.now();
    const due: HeldLock[] = [];
    for (const lock of this.locks) {
      if (lostAt(lock) <= t) {
        this.locks.delete(lock);
        this.hooks.lost(lock, 'lease-expired');
      } else if (lock.watchdog && !lock.renewing && lock.renewAt <= t + lock.leaseMs / 6) {
        due.push(lock);
      }
    }
    if (due.length > 0) this.renew(due, t);
    this.reschedule();
  }

  private renew(due: HeldLock[], start: number): void {
    const groups = new Map<number, HeldLock[]>();
    for (const lock of due) {
      lock.renewing = true;
      const group = this.hooks.group(lock);
      const locks = groups.get(group);
      if (locks) locks.push(lock);
      else groups.set(group, [lock]);
    }
    for (const locks of groups.values()) this.renewGroup(locks, start);
  }

  private renewGroup(due: HeldLock[], start: number): void {
    const afterMs = this.unansweredAfterMs;
    const unanswered =
      afterMs === undefined
        ? undefined
        : this.time.setTimeout(() => {
            const watched = due.filter((lock) => this.locks.has(lock));
            if (watched.length > 0) this.hooks.renewUnanswered(watched, afterMs);
          }, afterMs);
    unanswered?.unref();
    const answered = () => {
      if (unanswered) this.time.clearTimeout(unanswered);
    };
    this.hooks.renew(due).then(
      (results) => {
        answered();
        const renewed: HeldLock[] = [];
        due.forEach((lock, i) => {
          lock.renewing = false;
          if (!this.locks.has(lock)) return;
          if (results[i]) {
            lock.setLease(start, lock.leaseMs);
            renewed.push(lock);
          } else {
            this.locks.delete(lock);
            this.hooks.lost(lock, 'taken');
          }
        });
        if (renewed.length > 0) this.hooks.renewed(renewed);
        this.reschedule();
      },
      (error: unknown) => {
        answered();
        const t = this.time.now();
        for (const lock of due) {
          lock.renewing = false;
          lock.renewAt = t + Math.min(1_000, lock.leaseMs / 10);
        }
        this.hooks.renewFailed(due, error);
        this.reschedule();
      },
    );
  }

  private reschedule(): void {
    let next = Infinity;
    for (const lock of this.locks) {
      next = Math.min(next, lostAt(lock), lock.renewing ? Infinity : lock.renewAt);
    }
    if (next < Infinity) this.schedule(next);
  }
}
