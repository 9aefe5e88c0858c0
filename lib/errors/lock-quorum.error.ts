import { LockError } from './lock.error.js';

/** How one Redlock node answered an acquisition attempt. */
export interface RedlockVote {
  /** The node, as `host:port`. */
  node: string;
  /** `granted`; `held` by another owner; `error` (unreachable, timed out, refused: see `error`). */
  vote: 'granted' | 'held' | 'error';
  error?: string;
}

/**
 * Redlock: too few nodes answered for a quorum, so the lock could not be taken or kept. `votes`
 * says how each node answered. Bring the failed nodes back (a majority must be reachable).
 */
export class LockQuorumError extends LockError {
  override name = 'LockQuorumError';

  constructor(
    readonly key: string,
    readonly operation: string,
    readonly votes: readonly RedlockVote[],
    readonly quorum: number,
  ) {
    super(
      `Redlock ${operation} of "${key}" needs ${quorum} of ${votes.length} nodes; ` +
        `${votes.filter((v) => v.vote !== 'error').length} answered: ${votes.map((v) => `${v.node} ${v.vote}${v.error ? ` (${v.error})` : ''}`).join(', ')}. ` +
        'Bring the failed nodes back: a majority must be reachable.',
    );
  }
}
