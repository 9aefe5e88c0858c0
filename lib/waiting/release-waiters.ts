import { randomBytes } from 'node:crypto';
import { realTime, type Time } from '../internal/time.js';
import type { Handover, ReleaseWatch } from '../store/lock-store.js';

/** How many releases of one key in a row may take a waiter of the releasing process along (see `wakeBehindRelease`). */
export const MAX_HANDOFFS_IN_A_ROW = 4;

/**
 * The waiters of one process, queued per key in arrival order. One release notice wakes one waiter
 * (the longest-waiting one that is asleep), never all of them: the others would only race for the
 * same lock and go back to sleep. A notice that arrives while no waiter sleeps (they are all busy
 * with an attempt) is kept as a pending wake, so the next waiter to sleep retries at once instead of
 * missing the release.
 *
 * Stores feed it: the Redis store from its release channel, the memory store directly.
 *
 * Taking a waiter along (default mode, see `wakeBehindRelease`): when this process releases the
 * last hold of a lock one of its own waiters sleeps on, the store wakes that waiter as it sends the
 * release, so the waiter's attempt leaves in the same write and Redis runs it right behind the
 * release: one round trip from release to next holder, where a waiter woken by the release message
 * needs two. A waiter that may be handed the lock inside the release (an exclusive default-mode
 * wait, see `handoverLeaseMs`) sends nothing: the store's release script makes it the holder when
 * it frees the lock, and the waiter learns it from the release's reply. At most
 * MAX_HANDOFFS_IN_A_ROW releases of a key in a row do this; the next one wakes nobody early, so
 * waiters of other processes, woken by its message, get their chance.
 */
export class ReleaseWaiters {
  private readonly queues = new Map<string, KeyQueue>();
  /** Wait ids: unique to this process and this set, so a grant names one wait, never a later one of the same owner. */
  private readonly idPrefix = randomBytes(6).toString('base64url');
  private waitCount = 0;

  /** `time`: the timers of the waiters' lease-bounded sleeps (the store's, see LockStore.time). */
  constructor(private readonly time: Time = realTime) {}

  /**
   * Joins the queue of `key` as `owner`; `listening` as in ReleaseWatch. The caller must `close()`
   * the returned watch. `handoverLeaseMs`: this wait may be handed the lock inside a release of this
   * process, with that lease (see `wakeBehindRelease`).
   */
  join(key: string, owner: string, listening: Promise<boolean>, onLeave?: () => void, handoverLeaseMs?: number): ReleaseWatch {
    let queue = this.queues.get(key);
    if (!queue) {
      queue = { members: [], pendingWakes: 0, handoffsInARow: 0 };
      this.queues.set(key, queue);
    }
    const waiter = new Waiter(owner, `${this.idPrefix}.${++this.waitCount}`, queue, listening, () => {
      const q = queue!;
      const i = q.members.indexOf(waiter);
      if (i >= 0) q.members.splice(i, 1);
      if (q.members.length === 0) this.queues.delete(key);
      else q.pendingWakes = Math.min(q.pendingWakes, q.members.length);
      onLeave?.();
    }, () => this.notify(key), this.time, handoverLeaseMs);
    queue.members.push(waiter);
    return waiter;
  }

  /**
   * This process is about to release the last hold it has on `key` (an exclusive lock, not fair).
   * Returns the longest-sleeping waiter of `key`: its owner, the lease it may be handed the lock
   * with (undefined: it sends its own attempt), and `wake`, to be called right after the release is
   * sent. Given the release's verdict (`handover`: the grant, or undefined when the release did
   * not hand it the lock), the waiter takes that instead of sending an attempt; without it, its
   * attempt follows the release on the same connection. Returns undefined when no waiter of `key`
   * sleeps here, or when the last MAX_HANDOFFS_IN_A_ROW releases of `key` all took one along: this
   * release then wakes nobody early (its message wakes waiters here and in other processes alike),
   * and the count starts again.
   *
   * The release message that follows is for the woken waiter: while its attempt is in flight the
   * message is kept for it (it retries at once if that attempt was refused) instead of waking a
   * second waiter for the same release.
   */
  wakeBehindRelease(key: string): TakenAlong | undefined {
    const queue = this.queues.get(key);
    if (!queue) return undefined;
    const sleeper = queue.members.find((w) => w.asleep);
    if (!sleeper || queue.handoffsInARow >= MAX_HANDOFFS_IN_A_ROW) {
      queue.handoffsInARow = 0;
      return undefined;
    }
    queue.handoffsInARow++;
    return {
      owner: sleeper.owner,
      leaseMs: sleeper.handoverLeaseMs,
      wake: (handover) => {
        // Called right after wakeBehindRelease (nothing in between can end the sleep); false: the
        // waiter is not there to take a grant, which the store then gives back.
        if (!sleeper.asleep) return false;
        sleeper.wokenBehindRelease = true;
        sleeper.handover = handover;
        sleeper.wake();
        return true;
      },
    };
  }

  /** A release of `key` happened: wake one waiter. */
  notify(key: string): void {
    const queue = this.queues.get(key);
    if (!queue) return;
    const behind = queue.members.find((w) => w.wokenBehindRelease);
    if (behind) {
      behind.pendingWake = true;
      return;
    }
    const sleeper = queue.members.find((w) => w.asleep);
    if (sleeper) sleeper.wake();
    else queue.pendingWakes = Math.min(queue.pendingWakes + 1, queue.members.length);
  }

  /** A fair lock was released to `owner`: wake that waiter (now, or at its next sleep). */
  notifyOwner(key: string, owner: string): void {
    const waiter = this.queues.get(key)?.members.find((w) => w.owner === owner);
    if (!waiter) return;
    if (waiter.asleep) waiter.wake();
    else waiter.pendingWake = true;
  }

  /**
   * A fair release handed `key` to the wait `waitId` of `owner` (fencing token `token`): that
   * waiter's sleep ends with `granted` (now, or at its next sleep). No such waiter here: the grant
   * is another process's, its waiter already has it (the releaser's reply and the release message
   * both report it), or it left (leaving the queue gives such a grant back).
   */
  grant(key: string, owner: string, waitId: string, token: number): void {
    const waiter = this.queues.get(key)?.members.find((w) => w.waitId === waitId && w.owner === owner);
    // A grant up to the latest token a refused attempt of this wait saw is void, however late its
    // message comes (it was read after that attempt's reply: a process resumed from a pause).
    if (!waiter || waiter.grantedToken === token || token <= waiter.voidGrantsUpTo) return;
    waiter.grantedToken = token;
    if (waiter.asleep) waiter.wake('granted');
    else waiter.pendingGrant = true;
  }

  /** A read-write lock changed so that several waiters may get in: wake every waiter of `key`. */
  notifyEveryone(key: string): void {
    const queue = this.queues.get(key);
    if (!queue) return;
    for (const waiter of queue.members) {
      if (waiter.asleep) waiter.wake();
      else waiter.pendingWake = true;
    }
  }

  /** Releases may have been missed (a reconnect): wake one waiter of every key so each retries. */
  notifyAll(): void {
    for (const key of [...this.queues.keys()]) this.notify(key);
  }

  /** How many waiters are queued (all keys). */
  get size(): number {
    let n = 0;
    for (const q of this.queues.values()) n += q.members.length;
    return n;
  }

  /** How many waiters of `key` sleep (tests wait for it before a release). */
  asleep(key: string): number {
    return this.queues.get(key)?.members.filter((w) => w.asleep).length ?? 0;
  }

  /** Keys with at least one waiter. */
  keys(): string[] {
    return [...this.queues.keys()];
  }
}

/** A waiter a release takes along (see `wakeBehindRelease`). */
export interface TakenAlong {
  readonly owner: string;
  /** The lease to hand it the lock with inside the release; undefined: it sends its own attempt. */
  readonly leaseMs: number | undefined;
  /** Wakes it; false when it no longer sleeps (it then takes nothing from `handover`). */
  wake(handover?: Promise<Handover | undefined>): boolean;
}

interface KeyQueue {
  members: Waiter[];
  pendingWakes: number;
  /** Releases of this key in a row that took a waiter along (see `wakeBehindRelease`). */
  handoffsInARow: number;
}

type Wake = 'released' | 'timeout' | 'aborted' | 'granted';

class Waiter implements ReleaseWatch {
  private settle: ((how: Wake) => void) | undefined;
  private closed = false;
  /** A wake addressed to this waiter arrived while it was not asleep. */
  pendingWake = false;
  /** Woken as this process released the lock; its attempt since then is in flight (cleared at its next sleep). */
  wokenBehindRelease = false;
  /** The verdict of the release that took this waiter along, when that release could hand it the lock (see `takeHandover`). */
  handover: Promise<Handover | undefined> | undefined;
  /** A grant to this waiter's owner arrived while it was not asleep. */
  pendingGrant = false;
  grantedToken: number | undefined;
  /** The latest fencing token a refused attempt of this wait reported: grants up to it are void. */
  voidGrantsUpTo = 0;

  constructor(
    readonly owner: string,
    readonly waitId: string,
    private readonly queue: KeyQueue,
    readonly listening: Promise<boolean>,
    private readonly leave: () => void,
    private readonly wakeNext: () => void,
    private readonly time: Time,
    /** The lease a release of this process may hand this wait the lock with; undefined: never handed one. */
    readonly handoverLeaseMs?: number,
  ) {
    this.ready = listening.then(() => undefined);
  }

  readonly ready: Promise<void>;

  get asleep(): boolean {
    return this.settle !== undefined;
  }

  forgetGrant(lastToken?: number): void {
    if (lastToken !== undefined && lastToken > this.voidGrantsUpTo) this.voidGrantsUpTo = lastToken;
    if (lastToken === undefined || (this.grantedToken ?? 0) <= lastToken) this.pendingGrant = false;
  }

  wake(how: 'released' | 'granted' = 'released'): void {
    this.settle?.(how);
  }

  takeHandover(): Promise<Handover | undefined> | undefined {
    const handover = this.handover;
    this.handover = undefined;
    return handover;
  }

  sleep(timeoutMs: number, signal?: AbortSignal): Promise<Wake> {
    this.wokenBehindRelease = false;
    this.handover = undefined;
    if (signal?.aborted) return Promise.resolve('aborted');
    if (this.pendingGrant) {
      this.pendingGrant = false;
      return Promise.resolve('granted');
    }
    if (this.pendingWake) {
      this.pendingWake = false;
      return Promise.resolve('released');
    }
    if (this.queue.pendingWakes > 0) {
      this.queue.pendingWakes--;
      return Promise.resolve('released');
    }
    return new Promise((resolve) => {
      const onAbort = () => finish('aborted');
      const timer = this.time.setTimeout(() => finish('timeout'), Math.max(0, Math.min(timeoutMs, 2_147_483_647)));
      const finish = (how: Wake) => {
        if (this.settle !== finish) return;
        this.settle = undefined;
        this.time.clearTimeout(timer);
        signal?.removeEventListener('abort', onAbort);
        resolve(how);
      };
      this.settle = finish;
      signal?.addEventListener('abort', onAbort, { once: true });
    });
  }

  close(passWake = false): void {
    if (this.closed) return;
    this.closed = true;
    this.settle?.('aborted');
    this.leave();
    if (passWake) this.wakeNext();
  }
}
