import { LockError } from './lock.error.js';

/**
 * An owner holding only the read side of a read-write lock asked for its write side. Waiting
 * would deadlock as soon as two readers did it, so the request is refused at once.
 *
 * @example
 * // Take the write lock from the start when the work may write:
 * await locks.run(`doc:${id}`, async () => edit(id), { mode: 'write' });
 */
export class LockUpgradeError extends LockError {
  override name = 'LockUpgradeError';

  constructor(readonly key: string) {
    super(
      `Lock "${key}": this owner holds the read lock and asked for the write lock. Upgrading is not supported ` +
        '(two readers upgrading at once would deadlock): release the read lock first, or take the write lock from the start (a writer may also read).',
    );
  }
}
