import { LockError } from './lock.error.js';

/** Why a held lock stopped being ours. */
export type LockLossReason =
  /** The lease ran out: a fixed lease ended, or renewals failed until the local lease deadline passed. */
  | 'lease-expired'
  /** Redis says the key is gone or belongs to another owner (deleted, force-unlocked, or expired and taken). */
  | 'taken'
  /** The module is shutting down and released the lock. */
  | 'shutdown';

/**
 * The lock is no longer held by this owner. `handle.signal` aborts with this error the moment the
 * loss is known; work protected by the lock should stop at its next step.
 *
 * @example
 * await locks.run('invoice:42', async (lock) => {
 *   for (const line of lines) {
 *     lock.signal.throwIfAborted(); // throws LockLostError once the lock is lost
 *     await write(line);
 *   }
 * });
 */
export class LockLostError extends LockError {
  override name = 'LockLostError';

  constructor(
    readonly key: string,
    readonly owner: string,
    readonly reason: LockLossReason,
    /** How long the lock had been held when the loss was noticed, in milliseconds. */
    readonly heldMs: number,
    options?: { cause?: unknown },
  ) {
    super(`Lock "${key}" was lost after ${Math.round(heldMs)} ms: ${describe(reason)}.`, options);
  }
}

function describe(reason: LockLossReason): string {
  switch (reason) {
    case 'lease-expired':
      return 'its lease ended before it could be renewed (fixed lease reached, Redis unreachable, or the event loop was blocked); another owner may now hold it';
    case 'taken':
      return 'Redis no longer lists this owner (the key was deleted, force-unlocked, or expired and was taken by another owner)';
    case 'shutdown':
      return 'the lock module is shutting down and released it';
  }
}
