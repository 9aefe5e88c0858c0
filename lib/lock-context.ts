import type { LockGroup } from './lock-group.js';
import type { LockHandle } from './lock-handle.js';

/**
 * One logical execution context: everything that runs inside it (however deep in awaits) is one
 * owner. A context starts when code takes a lock through `run()`, a `@Locked` method, or
 * `handle.run()`; each of them nests a child context that knows its handle, so `current()` finds
 * the innermost lock. Internal.
 */
export interface LockContext {
  readonly owner: string;
  readonly handle?: LockHandle;
  /** Set when the context was started by a multi-key lock. */
  readonly group?: LockGroup;
  readonly parent?: LockContext;
}
