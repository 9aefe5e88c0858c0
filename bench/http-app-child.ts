// Scenario 4's Nest app (bench/http-app.ts) in a child process, as `npm run bench` and
// `npm run bench:profile` both drive it: one endpoint at a time under autocannon.
import autocannon from 'autocannon';
import { fork } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

export interface HttpAppChild {
  /** Loads `/<endpoint>/<id>` (a fresh id per request) with 16 connections for `seconds`. */
  load(endpoint: string, seconds: number): Promise<autocannon.Result>;
  /** The app process's CPU time so far, in microseconds (user + system). */
  cpuUs(): Promise<number>;
  stop(): Promise<void>;
}

/** Starts the app on `redisUrl`; resolves once it listens. */
export async function startHttpApp(redisUrl: string): Promise<HttpAppChild> {
  const child = fork(join(dirname(fileURLToPath(import.meta.url)), 'http-app.js'), [redisUrl], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
  const base = await new Promise<string>((resolve) => child.once('message', (m: { url: string }) => resolve(m.url)));
  return {
    load: (endpoint, seconds) => autocannon({ url: `${base}/${endpoint}/[<id>]`, idReplacement: true, connections: 16, duration: seconds }),
    cpuUs: () =>
      new Promise<number>((resolve) => {
        child.once('message', (m: { usage: NodeJS.CpuUsage }) => resolve(m.usage.user + m.usage.system));
        child.send({ type: 'cpu' });
      }),
    stop: async () => {
      child.send({ type: 'stop' });
      await new Promise((resolve) => child.once('exit', resolve));
    },
  };
}
