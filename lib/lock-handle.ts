import { LockConfigurationError } from './errors/lock-configuration.error.js';
import type { HeldLock } from './held-lock.js';
import type { LockContext } from './lock-context.js';
import type { LockMode } from './store/lock-store.js';

/** @internal What a handle needs from the service that issued it. */
export interface LockHandleHost {
  /** Declares the lock lost now if its lease deadline has passed (the watchdog's timer may not have run yet). */
  checkDeadline(lock: HeldLock): void;
  releaseHandle(lock: HeldLock, keepMs?: number, context?: LockContext): Promise<void>;
  extendHandle(lock: HeldLock, leaseMs: number, handle: LockHandle): Promise<void>;
  runInContext<T>(context: LockContext, fn: () => T): T;
  /** Why grants carry no fencing token (a sentence that says what to change), or undefined when they do. */
  readonly noFencingTokens: string | undefined;
}

/**
 * One hold of a lock, as returned by `acquire()` and passed to `run()` callbacks. Every re-entry
 * gets its own handle; the lock is free when every handle is released.
 *
 * @example
 * const lock = await locks.acquire('invoice:42');
 * try {
 *   await work(lock.signal);
 * } finally {
 *   await lock.release();
 * }
 */
export class LockHandle {
  private isReleased = false;

  /** @internal */
  constructor(
    private readonly host: LockHandleHost,
    /** @internal */ readonly lock: HeldLock,
    /** @internal */ readonly context: LockContext,
    /** The owner's hold count right after this acquisition: 1 for a fresh lock, 2 for a first re-entry, ... */
    readonly holdCount: number,
  ) {}

  /** The lock's key, as given. */
  get key(): string {
    return this.lock.key;
  }

  /** The owner id this lock is held under in Redis. */
  get owner(): string {
    return this.lock.owner;
  }

  /**
   * Which side of the key this handle holds: `'exclusive'` (a plain lock), or `'read'` or `'write'`
   * (a read-write lock). A writer that also reads holds a `'write'` handle and a `'read'` one.
   */
  get mode(): LockMode {
    return this.lock.mode;
  }

  /**
   * The fencing token of this grant: larger than every token issued before for this key (see the
   * README's guarantees). Re-entries share the token of the grant they re-enter.
   */
  get fencingToken(): number {
    if (Number.isNaN(this.lock.fencingToken)) {
      throw new LockConfigurationError('fencingToken', `Lock "${this.lock.key}" has no fencing token: ${this.host.noFencingTokens ?? 'none was issued.'}`);
    }
    return this.lock.fencingToken;
  }

  /**
   * Aborts with a `LockLostError` as soon as the lock is known to be lost. Reading it also checks
   * the lease deadline on the spot: a process that was paused or blocked past its lease sees the
   * loss here before its next step, even before the watchdog's own timer has run.
   */
  get signal(): AbortSignal {
    this.host.checkDeadline(this.lock);
    return this.lock.signal;
  }

  /** True while this handle is neither released nor its lock lost (checks the lease deadline too). */
  get isHeld(): boolean {
    this.host.checkDeadline(this.lock);
    return !this.isReleased && !this.lock.lost;
  }

  /** True once `release()` was called on this handle. */
  get released(): boolean {
    return this.isReleased;
  }

  /**
   * Gives this hold back. Idempotent: a second call does nothing. After a loss it does nothing
   * either (the loss was already reported through `signal`). Rejects with `LockBackendError` only
   * when Redis failed, or did not answer within 1 s (the release was sent, and runs if Redis comes
   * back); the lease frees the lock otherwise.
   */
  release(): Promise<void> {
    if (this.isReleased) return Promise.resolve();
    this.isReleased = true;
    return this.host.releaseHandle(this.lock);
  }

  /**
   * @internal Gives this hold back; if it is the last one, the lock stays in Redis for `keepMs` more
   * (as a fixed lease, no renewal) instead of being deleted. Used for `minHoldMs`.
   */
  releaseAfter(keepMs: number): Promise<void> {
    if (this.isReleased) return Promise.resolve();
    this.isReleased = true;
    return this.host.releaseHandle(this.lock, keepMs, this.context);
  }

  /**
   * Sets the lock's remaining lease to `leaseMs` from now (for a watchdog lock, also the lease it
   * is renewed with). On a lock that others hold too (other readers, this owner's other side, or
   * another process under the same owner token) it only lengthens the lease. Rejects with
   * `LockLostError` if the lock is no longer held, and with `LockBackendError` when Redis failed or
   * did not answer within `stepTimeoutMs` (1 s by default).
   */
  extend(leaseMs: number): Promise<void> {
    return this.host.extendHandle(this.lock, leaseMs, this);
  }

  /** Runs `fn` in this lock's owner context: locks taken inside re-enter this one. */
  run<T>(fn: () => T): T {
    return this.host.runInContext({ owner: this.lock.owner, handle: this, parent: this.context }, fn);
  }

  /** `await using lock = await locks.acquire(key)` releases at the end of the block. */
  [Symbol.asyncDispose](): Promise<void> {
    return this.release();
  }
}
