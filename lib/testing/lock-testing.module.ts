import { Module, type DynamicModule } from '@nestjs/common';
import { LockConfigurationError } from '../errors/lock-configuration.error.js';
import { assertOptionsObject, LockModule, type LockModuleGlobal } from '../lock.module.js';
import type { LockModuleOptions } from '../lock-options.js';

/**
 * `LockModule` on the in-process memory store, for your own tests: the same `LockService`,
 * `@Locked` and semantics (reentrancy, leases, waiting, fairness, read-write, multi-key, fencing),
 * no Redis needed. It locks within one process only: never use it as a distributed lock. Its
 * leases, waits, renewals and `minHoldMs` follow Jest's fake timers (advance them with
 * `jest.advanceTimersByTimeAsync()`).
 *
 * @example
 * const moduleRef = await Test.createTestingModule({
 *   imports: [LockTestingModule.forRoot({ isGlobal: true }), OrdersModule],
 * }).compile();
 */
@Module({})
export class LockTestingModule {
  static forRoot(options: Omit<LockModuleOptions, 'store' | 'redis'> & LockModuleGlobal = {}): DynamicModule {
    assertOptionsObject(options, 'LockTestingModule.forRoot()');
    // Its store is always the memory store: another store or a redis given here would be ignored,
    // and the test would not run on the Redis it names.
    const given = options as Partial<LockModuleOptions> | null;
    const ignored = given?.redis !== undefined ? 'redis' : given?.store !== undefined && given.store !== 'memory' ? 'store' : undefined;
    if (ignored) {
      throw new LockConfigurationError(
        ignored,
        `LockTestingModule.forRoot() always locks in the memory store of this process; leave ${ignored} out, or import LockModule.forRoot({ redis }) to test against Redis.`,
      );
    }
    return LockModule.forRoot({ ...options, store: 'memory' });
  }
}
