import type { LockLossReason } from './errors/lock-lost.error.js';

interface LockEventBase {
  key: string;
  owner: string;
}

/** The lock was granted fresh (not a re-entry). */
export interface LockAcquiredEvent extends LockEventBase {
  type: 'acquired';
  waitedMs: number;
  fencingToken: number;
}
/** The owner took a lock it already held; `holdCount` is the count after it. */
export interface LockReenteredEvent extends LockEventBase {
  type: 'reentered';
  holdCount: number;
}
/** One hold was released; `holdCount` is what is left (0: the lock is free). */
export interface LockReleasedEvent extends LockEventBase {
  type: 'released';
  holdCount: number;
  heldMs: number;
}
/** Another owner holds the lock; this caller starts waiting (or gives up at once). */
export interface LockContendedEvent extends LockEventBase {
  type: 'contended';
  retryAfterMs: number | undefined;
}
/** The caller gave up: the lock stayed held for the whole wait. */
export interface LockTimedOutEvent extends LockEventBase {
  type: 'timed-out';
  waitedMs: number;
}
/** The watchdog renewed the lock. */
export interface LockRenewedEvent extends LockEventBase {
  type: 'renewed';
  leaseMs: number;
}
/**
 * A renewal failed (it is retried until the lease deadline), or has had no answer for the module's
 * `stepTimeoutMs` (a `LockBackendError` saying so; it is still waited for until the lease deadline).
 */
export interface LockRenewFailedEvent extends LockEventBase {
  type: 'renew-failed';
  error: unknown;
}
/** The lock is no longer held by this owner; the handle's signal has aborted. */
export interface LockLostEvent extends LockEventBase {
  type: 'lost';
  reason: LockLossReason;
  heldMs: number;
  error: Error;
}
/** Giving the lock back failed; its lease frees it at the latest. */
export interface LockReleaseFailedEvent extends LockEventBase {
  type: 'release-failed';
  error: unknown;
}

/** A `@Locked` method with `onContention: 'skip'` did not run: another owner held its lock. */
export interface LockSkippedEvent extends LockEventBase {
  type: 'skipped';
  /** The decorated method, `Class.method`. */
  method: string;
}

/** Everything `LockService.events$` emits. Switch on `type`. */
export type LockEvent =
  | LockAcquiredEvent
  | LockReenteredEvent
  | LockReleasedEvent
  | LockContendedEvent
  | LockTimedOutEvent
  | LockRenewedEvent
  | LockRenewFailedEvent
  | LockLostEvent
  | LockReleaseFailedEvent
  | LockSkippedEvent;
