// Jest in native ESM mode (Nest 12 is ESM-only), TypeScript transformed by @swc/jest.
// NEST_COMPAT=<dir> sends every @nestjs/* import (and ioredis, rxjs, reflect-metadata) to
// compat/<dir>, so the same suite runs on the oldest releases the peer ranges accept as well as on
// the newest (Nest 12, ioredis 6, from the root): compat/nest11 holds Nest 11.0.0 with ioredis 5.9.0,
// compat/nest12 the oldest Nest 12 with ioredis 6.0.0, both with rxjs 7.2.0 and reflect-metadata
// 0.1.13, and each with the @nestjs/graphql, @nestjs/apollo and @nestjs/mercurius of its Nest
// major (the GraphQL test), its @nestjs/swagger (the OpenAPI test) and its @nestjs/cqrs (the CQRS
// test). NEST_MAJOR=11 alone means NEST_COMPAT=nest11.
import { swcOptions } from './scripts/compile-ts.mjs';

const compatDir = process.env.NEST_COMPAT || (process.env.NEST_MAJOR === '11' ? 'nest11' : '');
const compat = `<rootDir>/compat/${compatDir}/node_modules`;

/** @type {import('jest').Config} */
export default {
  rootDir: '.',
  // Node's environment, failing a test on a DeprecationWarning or MaxListenersExceededWarning too.
  testEnvironment: '<rootDir>/test/support/jest-environment.mjs',
  roots: ['<rootDir>/test'],
  testMatch: ['**/*.spec.ts'],
  // The fault and packaging suites have their own commands (npm run test:faults, test:packaging).
  testPathIgnorePatterns: ['\\.faults\\.spec\\.ts$', '\\.packaging\\.spec\\.ts$', '/test/packaging/apps/'],
  extensionsToTreatAsEsm: ['.ts'],
  transform: {
    '^.+\\.ts$': ['@swc/jest', swcOptions],
  },
  moduleNameMapper: {
    ...(compatDir
      ? {
          '^@nestjs/(common|core|testing|platform-express|platform-fastify|microservices|websockets|platform-socket.io|graphql|apollo|mercurius|swagger|cqrs)$': `${compat}/@nestjs/$1`,
          '^@nestjs/(common|core|testing|platform-express|platform-fastify|microservices|websockets|platform-socket.io|graphql|apollo|mercurius|swagger|cqrs)/(.*)$': `${compat}/@nestjs/$1/$2`,
          '^ioredis$': `${compat}/ioredis`,
          '^ioredis/(.*)$': `${compat}/ioredis/$1`,
          // One graphql for all: Mercurius, which only the root installs, must build on the schema
          // of compat's @nestjs/graphql (graphql refuses a schema made by another copy of itself).
          '^graphql$': `${compat}/graphql`,
          '^graphql/(.*)$': `${compat}/graphql/$1`,
          '^rxjs$': `${compat}/rxjs`,
          '^rxjs/(.*)$': `${compat}/rxjs/$1`,
          '^reflect-metadata$': `${compat}/reflect-metadata`,
          '^reflect-metadata/(.*)$': `${compat}/reflect-metadata/$1`,
        }
      : {}),
    '^(\\.{1,2}/.*)\\.js$': '$1',
  },
  globalSetup: '<rootDir>/test/support/global-setup.mjs',
  testTimeout: 60_000,
  // Real Redis servers and child processes per file: two files at a time fit two cores.
  maxWorkers: 2,
  // How long Jest waits for a worker to exit at the end before it calls it leaked (default 500 ms).
  // It starts that clock in this process, so when this process is itself slow to run (both cores
  // busy), a worker that exited at once is reported as force-exited: seen on this machine with the
  // workers' own exit 2 ms after Jest asked. A worker that a real leak (socket, interval, child
  // process) keeps alive is still caught, after 5 s instead of 0.5 s.
  workerGracefulExitTimeout: 5_000,
};
