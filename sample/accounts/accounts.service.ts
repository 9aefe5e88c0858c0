import { ConflictException, Inject, Injectable, type OnApplicationShutdown } from '@nestjs/common';
import type { Redis } from 'ioredis';
import type { MemoryKv } from '../memory-kv.js';
import { setTimeout as sleep } from 'node:timers/promises';
import { Locked, LockService } from '../../lib/index.js';
import { SAMPLE_OPTIONS, SAMPLE_REDIS } from '../sample.constants.js';
import type { SampleOptions } from '../app.module.js';

export interface Balance {
  id: string;
  balance: number;
  /** Which instance served the request. */
  instance: string;
  /** The lock's hold count inside the service: 2 when the controller already held it (re-entry). */
  holdCount?: number;
}

/**
 * Balances are read, checked and written back in three steps: without the lock, two withdrawals
 * at once would both read the same balance and one update would be lost.
 */
@Injectable()
export class AccountsService implements OnApplicationShutdown {
  constructor(
    private readonly locks: LockService,
    @Inject(SAMPLE_REDIS) private readonly redis: Redis | MemoryKv,
    @Inject(SAMPLE_OPTIONS) private readonly options: SampleOptions,
  ) {}

  @Locked('account:<0>')
  async deposit(id: string, amount: number): Promise<Balance> {
    const balance = await this.balance(id);
    await this.redis.set(this.balanceKey(id), balance + amount);
    return { id, balance: balance + amount, instance: this.options.instance };
  }

  /** Locked on its own too: called from the locked controller handler, it re-enters (hold count 2). */
  @Locked('account:<0>')
  async withdraw(id: string, amount: number): Promise<Balance> {
    const lock = this.locks.current('account:' + id)!;
    const balance = await this.balance(id);
    if (balance < amount) throw new ConflictException(`account ${id} has ${balance}, cannot withdraw ${amount}`);
    await sleep(5); // the slow part of a real withdrawal: fraud checks, a ledger call...
    lock.signal.throwIfAborted(); // stop before writing if the lock was lost meanwhile
    await this.redis.set(this.balanceKey(id), balance - amount);
    return { id, balance: balance - amount, instance: this.options.instance, holdCount: lock.holdCount };
  }

  /** A long audit that keeps the account locked for `seconds`. */
  @Locked('account:<0>')
  async audit(id: string, seconds: number): Promise<Balance> {
    await sleep(seconds * 1_000, undefined, { signal: this.locks.current()!.signal });
    return { id, balance: await this.balance(id), instance: this.options.instance };
  }

  async balance(id: string): Promise<number> {
    return Number((await this.redis.get(this.balanceKey(id))) ?? 0);
  }

  async onApplicationShutdown(): Promise<void> {
    await this.redis.quit();
  }

  private balanceKey(id: string): string {
    return `sample:balance:${id}`;
  }
}
