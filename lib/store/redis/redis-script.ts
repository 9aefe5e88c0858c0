import { createHash } from 'node:crypto';
import type { Cluster, Redis } from 'ioredis';
import { batchWrites } from './write-batching.js';

/**
 * One Lua script: sent by SHA (EVALSHA), with the full text as a fallback when the server does not
 * know it (after a restart or SCRIPT FLUSH). Unlike ioredis `defineCommand`, it adds nothing to a
 * client the user passed in.
 */
export class RedisScript {
  readonly sha: string;

  constructor(
    readonly name: string,
    readonly lua: string,
  ) {
    this.sha = createHash('sha1').update(lua).digest('hex');
  }

  /** `withNext`: more commands follow in this pass; see `batchWrites`. */
  run(client: Redis | Cluster, keys: readonly string[], args: readonly (string | number)[], withNext = false): Promise<unknown> {
    batchWrites(client, withNext);
    return client.evalsha(this.sha, keys.length, ...keys, ...args).catch((error: unknown) => {
      if (!(error instanceof Error) || !error.message.startsWith('NOSCRIPT')) throw error;
      return client.eval(this.lua, keys.length, ...keys, ...args);
    });
  }

  async load(client: Redis): Promise<void> {
    await client.script('LOAD', this.lua);
  }
}
