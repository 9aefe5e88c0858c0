// `npm run sample`: builds the demo app and starts two instances of it that share one Redis.
// Redis: $REDIS_URL if set; else 127.0.0.1:6379 if it answers; else a private redis-server started
// here (and stopped on exit) when the binary is installed; else it explains how to get Redis.
// Ports: $PORT_A (default 3000) and $PORT_B (default 3001); 0 takes a free port (each instance prints its own).
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync } from 'node:fs';
import { createConnection, createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const children = [];
let stopping = false;

function stopAll(code = 0) {
  if (stopping) return;
  stopping = true;
  for (const child of children) child.kill('SIGTERM');
  setTimeout(() => process.exit(code), 1_500).unref();
  Promise.all(children.map((c) => new Promise((r) => (c.exitCode !== null || c.signalCode !== null ? r() : c.once('exit', r))))).then(() =>
    process.exit(code),
  );
}
process.on('SIGINT', () => stopAll(0));
process.on('SIGTERM', () => stopAll(0));

/** Whether a Redis answers PING at host:port within 500 ms. */
function pingRedis(host, port) {
  return new Promise((resolve) => {
    const socket = createConnection({ host, port });
    const done = (ok) => (socket.destroy(), resolve(ok));
    socket.setTimeout(500, () => done(false));
    socket.once('error', () => done(false));
    socket.once('connect', () => socket.write('PING\r\n'));
    socket.once('data', (d) => done(d.toString().startsWith('+PONG')));
  });
}

function freePort() {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

async function findRedis() {
  if (process.env.REDIS_URL) return { url: process.env.REDIS_URL, how: 'from REDIS_URL' };
  if (await pingRedis('127.0.0.1', 6379)) return { url: 'redis://127.0.0.1:6379', how: 'the local Redis on 6379' };
  if (spawnSync('redis-server', ['--version'], { stdio: 'ignore' }).status === 0) {
    const port = await freePort();
    const server = spawn('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--dir', mkdtempSync(join(tmpdir(), 'sample-redis-'))], {
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    children.push(server);
    await new Promise((resolve, reject) => {
      let log = '';
      server.stdout.on('data', (d) => {
        log += d;
        if (log.includes('Ready to accept connections')) resolve();
      });
      server.once('exit', (code) => reject(new Error(`redis-server exited (${code})`)));
    });
    return { url: `redis://127.0.0.1:${port}`, how: `a private redis-server on port ${port} (stopped when the demo stops)` };
  }
  return undefined;
}

const redis = await findRedis();
if (!redis) {
  console.warn(
    'No Redis found: REDIS_URL is not set, nothing answers on 127.0.0.1:6379, and redis-server is not installed.\n' +
      'Starting ONE instance on the in-process memory store instead. Its locks protect this one process only:\n' +
      'this shows the API, not a distributed lock. For the two-instance demo, install Redis\n' +
      '(Debian/Ubuntu: sudo apt-get install -y redis-server; macOS: brew install redis) or set REDIS_URL.',
  );
}

const tsc = join(root, 'node_modules', 'typescript', 'bin', 'tsc');
if (spawnSync(process.execPath, [tsc, '-p', join(root, 'tsconfig.sample.json')], { stdio: 'inherit', cwd: root }).status !== 0) {
  stopAll(1);
} else {
  if (redis) console.log(`Locks and balances live in ${redis.url} (${redis.how}).`);
  const ports = [Number(process.env.PORT_A ?? 3000), Number(process.env.PORT_B ?? 3001)];
  (redis ? ['A', 'B'] : ['A']).forEach((instance, i) => {
    const store = redis ? { REDIS_URL: redis.url } : { SAMPLE_STORE: 'memory' };
    const child = spawn(process.execPath, [join(root, 'dist-sample', 'sample', 'main.js')], {
      cwd: root,
      env: { ...process.env, PORT: String(ports[i]), ...store, INSTANCE: instance },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    const prefix = (stream, out) =>
      stream.on('data', (d) => {
        for (const line of d.toString().split('\n')) if (line) out.write(`[${instance}] ${line}\n`);
      });
    prefix(child.stdout, process.stdout);
    prefix(child.stderr, process.stderr);
    child.once('exit', (code) => {
      if (!stopping) {
        console.error(`instance ${instance} exited (${code}); stopping the demo`);
        stopAll(code ?? 1);
      }
    });
    children.push(child);
  });
  console.log('Press Ctrl-C to stop.');
}
