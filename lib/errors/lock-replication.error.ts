import { LockError } from './lock.error.js';

/**
 * With `replication` configured: Redis granted the lock on the master, but fewer replicas than
 * required acknowledged it within `replication.timeoutMs`, so a failover could forget it. The grant
 * was given back (unless `onUnconfirmedAcquire: 'keep'`). Retry later, check the replicas' health
 * (`INFO replication`), or raise `replication.timeoutMs`.
 */
export class LockReplicationError extends LockError {
  override name = 'LockReplicationError';

  constructor(
    readonly key: string,
    /** Replicas that acknowledged in time. */
    readonly acknowledged: number,
    /** Replicas required (`replication.replicas`). */
    readonly required: number,
    readonly timeoutMs: number,
  ) {
    super(
      `Lock "${key}" was granted by the Redis master, but only ${acknowledged} of ${required} required replica(s) acknowledged it within ${timeoutMs} ms; it was given back. ` +
        `Check the replicas (INFO replication), raise replication.timeoutMs, or set replication.onUnconfirmedAcquire: 'keep'.`,
    );
  }
}
