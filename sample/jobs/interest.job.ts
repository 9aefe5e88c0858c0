import { Inject, Injectable, Logger } from '@nestjs/common';
import { Cron } from '@nestjs/schedule';
import type { Redis } from 'ioredis';
import type { MemoryKv } from '../memory-kv.js';
import { Locked } from '../../lib/index.js';
import type { SampleOptions } from '../app.module.js';
import { SAMPLE_OPTIONS, SAMPLE_REDIS } from '../sample.constants.js';

/** Every 5 seconds by default; the demo's own test sets SAMPLE_INTEREST_CRON to every second. */
const INTEREST_CRON = process.env.SAMPLE_INTEREST_CRON ?? '*/5 * * * * *';

/**
 * Fires on every instance, but the lock lets one instance per tick do the work: the other finds
 * the lock held and skips. minHoldMs keeps the lock past the (short) job, so an instance whose
 * trigger fires a little late still skips the same tick.
 */
@Injectable()
export class InterestJob {
  private readonly logger = new Logger(InterestJob.name);

  constructor(
    @Inject(SAMPLE_REDIS) private readonly redis: Redis | MemoryKv,
    @Inject(SAMPLE_OPTIONS) private readonly options: SampleOptions,
  ) {}

  @Cron(INTEREST_CRON)
  @Locked('job:interest', { onContention: 'skip', minHoldMs: 900 })
  async payInterest(): Promise<void> {
    const tick = Math.floor(Date.now() / 1000);
    await this.redis.rpush('sample:interest-runs', JSON.stringify({ tick, instance: this.options.instance }));
    this.logger.log(`instance ${this.options.instance} paid interest for tick ${tick}`);
  }
}
