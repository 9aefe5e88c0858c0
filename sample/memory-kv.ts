/**
 * The few Redis commands the demo uses for its own data (balances, the job journal), kept in this
 * process's memory: for `npm run sample` on a machine without any Redis.
 */
export class MemoryKv {
  private readonly values = new Map<string, string>();
  private readonly lists = new Map<string, string[]>();

  async get(key: string): Promise<string | null> {
    return this.values.get(key) ?? null;
  }

  async set(key: string, value: string | number): Promise<'OK'> {
    this.values.set(key, String(value));
    return 'OK';
  }

  async rpush(key: string, value: string): Promise<number> {
    const list = this.lists.get(key) ?? [];
    list.push(value);
    this.lists.set(key, list);
    return list.length;
  }

  async lrange(key: string, start: number, stop: number): Promise<string[]> {
    const list = this.lists.get(key) ?? [];
    return list.slice(start, stop === -1 ? undefined : stop + 1);
  }

  async quit(): Promise<'OK'> {
    return 'OK';
  }
}
