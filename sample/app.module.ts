import { Logger, Module, type DynamicModule } from '@nestjs/common';
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
        { provide: SAMPLE_REDIS, useFactory: () => (options.redisUrl ? dataClient(options.redisUrl) : new MemoryKv()) },
      ],
    };
  }
}

/**
 * The demo's own connection for its data. An ioredis client with no 'error' listener prints
 * "[ioredis] Unhandled error event" with a stack on every failed reconnect while Redis is down;
 * this one logs each message once, until it is connected again (as LockService does for its own).
 */
function dataClient(url: string): Redis {
  const logger = new Logger('SampleData');
  const client = new Redis(url);
  let lastError = '';
  client.on('error', (e: Error) => {
    if (e.message !== lastError) logger.warn(`Redis connection: ${e.message}`);
    lastError = e.message;
  });
  client.on('ready', () => (lastError = ''));
  return client;
}
