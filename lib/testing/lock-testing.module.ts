import { Module, type DynamicModule } from '@nestjs/common';
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
    return LockModule.forRoot({ ...options, store: 'memory' });
  }
}
