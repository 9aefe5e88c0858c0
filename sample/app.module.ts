import { Module, type DynamicModule } from '@nestjs/common';
import { ScheduleModule } from '@nestjs/schedule';
import { Redis } from 'ioredis';
import { LockModule } from '../lib/index.js';
import { AccountsController } from './accounts/accounts.controller.js';
import { AccountsService } from './accounts/accounts.service.js';
import { InterestJob } from './jobs/interest.job.js';
import { JobsController } from './jobs/jobs.controller.js';
import { MemoryKv } from './memory-kv.js';
import { SAMPLE_OPTIONS, SAMPLE_REDIS } from './sample.constants.js';

export interface SampleOptions {
  /** Where locks and the demo's data live; without it, both stay in this process (one instance only). */
  redisUrl?: string;
  /** Name shown in responses and job runs, e.g. "A" or "B". */
  instance: string;
}

/** The demo: accounts whose balances live in Redis, changed under a lock per account, and a job run by one instance per tick. */
@Module({})
export class AppModule {
  static register(options: SampleOptions): DynamicModule {
    return {
      module: AppModule,
      imports: [
        // Requests wait up to 2 s for an account's lock, then get 409 with Retry-After.
        options.redisUrl
          ? LockModule.forRoot({ redis: options.redisUrl, isGlobal: true, waitMs: 2_000 })
          : LockModule.forRoot({ store: 'memory', isGlobal: true, waitMs: 2_000 }),
        ScheduleModule.forRoot(),
      ],
      controllers: [AccountsController, JobsController],
      providers: [
        AccountsService,
        InterestJob,
        { provide: SAMPLE_OPTIONS, useValue: options },
        { provide: SAMPLE_REDIS, useFactory: () => (options.redisUrl ? new Redis(options.redisUrl) : new MemoryKv()) },
      ],
    };
  }
}
