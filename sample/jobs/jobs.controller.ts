import { Controller, Get, Inject } from '@nestjs/common';
import type { Redis } from 'ioredis';
import type { MemoryKv } from '../memory-kv.js';
import { SAMPLE_REDIS } from '../sample.constants.js';

@Controller('jobs')
export class JobsController {
  constructor(@Inject(SAMPLE_REDIS) private readonly redis: Redis | MemoryKv) {}

  /** Which instance ran the interest job at which tick (seconds since the epoch). */
  @Get('interest')
  async interestRuns() {
    const runs = await this.redis.lrange('sample:interest-runs', 0, -1);
    return runs.map((r) => JSON.parse(r) as { tick: number; instance: string });
  }
}
