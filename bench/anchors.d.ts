// redlock 5.0.0-beta.2 ships types that its package.json "exports" hides from NodeNext resolution.
declare module 'redlock' {
  import type { Redis } from 'ioredis';
  interface Lock {
    release(): Promise<unknown>;
  }
  export default class Redlock {
    constructor(clients: Redis[], settings?: { retryDelay?: number; retryJitter?: number; retryCount?: number });
    acquire(resources: string[], duration: number): Promise<Lock>;
  }
}
