// Starts one instance of the demo. `npm run sample` starts two of them (see scripts/sample.mjs).
//   PORT=3000 INSTANCE=A REDIS_URL=redis://127.0.0.1:6379 node dist-sample/sample/main.js
// PORT=0 takes a free port; the "listening on" line says which.
import 'reflect-metadata';
import { NestFactory } from '@nestjs/core';
import { AppModule } from './app.module.js';

const port = Number(process.env.PORT ?? 3000);
const instance = process.env.INSTANCE ?? 'A';
// SAMPLE_STORE=memory: no Redis at all; locks and data stay in this one process.
const redisUrl = process.env.SAMPLE_STORE === 'memory' ? undefined : (process.env.REDIS_URL ?? 'redis://127.0.0.1:6379');
const app = await NestFactory.create(AppModule.register({ redisUrl, instance }), { logger: ['error', 'warn', 'log'] });
app.enableShutdownHooks();
await app.listen(port, '127.0.0.1');
// The port it bound: PORT=0 takes a free one.
const bound = (app.getHttpServer().address() as import('node:net').AddressInfo).port;
console.log(`instance ${instance} listening on http://127.0.0.1:${bound} (locks in ${redisUrl ?? 'this process only: in-process memory store'})`);
