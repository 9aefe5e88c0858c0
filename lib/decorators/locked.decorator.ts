import { Inject, UseInterceptors } from '@nestjs/common';
import { Observable } from 'rxjs';
import { LockConfigurationError } from '../errors/lock-configuration.error.js';
import { assertLockKey, canonicalKeys } from '../lock-key.js';
import { describe, exclusiveGroup, validateLockedOptions, type LockedOptions } from '../lock-options.js';
import { LockInterceptor, withLockErrorsTranslated } from '../lock.interceptor.js';
import { LockService } from '../lock.service.js';
import { LOCKED_METADATA } from '../lock.constants.js';
import { declareCallSite, LockCallSite } from './lock-call-site.js';
import { LockKeyTemplate } from './lock-key.template.js';
import { invokeLocked, type LockedSpec } from './lock-pipeline.js';

/** The prototypes of generator, async generator and async functions (`function*`, `async function*`, `async`). */
const GENERATOR_FUNCTION: unknown = Object.getPrototypeOf(function* () {});
const ASYNC_GENERATOR_FUNCTION: unknown = Object.getPrototypeOf(async function* () {});
const ASYNC_FUNCTION: unknown = Object.getPrototypeOf(async function () {});

/** Where `@Locked` puts the injected LockService on instances. */
const LOCK_SERVICE = Symbol('nestjs-locked:lock-service');
/** Classes whose LockService property is already declared for injection. */
const injected = new WeakSet<object>();

/**
 * A key template, several of them (a multi-key lock), or a function of the method's arguments
 * that returns a key or several. A key function written with `function` gets the instance as `this`.
 */
export type LockedKey = string | readonly string[] | ((this: any, ...args: any[]) => string | readonly string[]);

/**
 * Runs the method under a reentrant Redis lock whose key is built from the arguments it receives
 * (after pipes). Works on controller handlers (HTTP on Express or Fastify, microservice and
 * WebSocket handlers), `@Cron`/`@Interval`/`@Timeout` jobs, `@OnEvent` listeners and plain provider
 * methods, above or below their other decorators. The class must be a Nest provider or controller in a module that
 * can inject `LockService`.
 *
 * The lock is held until the method's Promise settles; for a method that declares an Observable
 * return type, from subscription until it ends; for an async generator (`async *rows()`), from the
 * first `next()` until it returns, throws or is closed. Generator methods (`*rows()`) are refused.
 *
 * Templates: `<n>` is the n-th argument, `<n.a.b>` a property path of it; text outside is literal.
 * Values are percent-encoded for `%`, `:`, `{`, `}` (see the README).
 *
 * @example
 * @Post(':id/withdraw')
 * @Locked('account:<0>')
 * withdraw(@Param('id', ParseIntPipe) id: number, @Body() body: WithdrawDto) {}
 *
 * @example
 * @Cron(CronExpression.EVERY_MINUTE)
 * @Locked('jobs:cleanup', { onContention: 'skip', minHoldMs: 10_000 })
 * async cleanup() {}
 */
export function Locked(key: LockedKey, options?: LockedOptions): MethodDecorator {
  return (target, propertyKey, descriptor) => {
    const isStatic = typeof target === 'function';
    const className = (isStatic ? (target as { name: string }).name : target.constructor?.name) ?? 'anonymous class';
    const where = `@Locked on ${className}.${String(propertyKey)}`;
    if (propertyKey === undefined) {
      throw new LockConfigurationError('@Locked', `@Locked on class ${className}: @Locked goes on methods, not on classes; put it on each method to lock.`);
    }
    const method = descriptor?.value;
    if (typeof method !== 'function') {
      throw new LockConfigurationError('@Locked', `${where}: @Locked goes on methods, not on accessors or fields.`);
    }
    if (isStatic) {
      throw new LockConfigurationError('@Locked', `${where}: @Locked needs an instance method of a Nest provider or controller, not a static method.`);
    }
    const kind: unknown = Object.getPrototypeOf(method);
    if (kind === GENERATOR_FUNCTION) {
      throw new LockConfigurationError(
        '@Locked',
        `${where}: a generator method runs its body only as it is iterated, after the call has returned, and taking a lock is asynchronous, so @Locked cannot hold a lock around it. Make it an async generator (async *${String(propertyKey)}()), which @Locked locks from the first next() until it finishes or is closed.`,
      );
    }
    const spec = buildSpec(key, options, where, target, propertyKey, kind === ASYNC_GENERATOR_FUNCTION);
    // Where Nest passes the call site of a handler call (see lock-call-site.ts); undefined: the
    // interceptor translates lock failures instead.
    const siteIndex = declareCallSite(target, propertyKey, method as (...a: unknown[]) => unknown);

    const lockedMethod = function (this: Record<symbol, LockService | undefined>, ...args: unknown[]) {
      let site: LockCallSite | undefined;
      if (siteIndex !== undefined && args[siteIndex] instanceof LockCallSite) {
        site = args[siteIndex] as LockCallSite;
        args = [...args.slice(0, siteIndex), ...args.slice(siteIndex + 1)];
      } else if (siteIndex !== undefined && args.length === siteIndex + 1) {
        // Nest filled the call-site parameter in and a pipe replaced it (with anything, undefined
        // included: a call of the method's own passes fewer arguments): a lock that could not be
        // had would then reach the client as a 500 instead of a 409, so the call fails here, loudly.
        return failed(spec, changedCallSite(where, siteIndex, args[siteIndex]));
      }
      // isPrototypeOf answers false for undefined and null too.
      if (!Object.prototype.isPrototypeOf.call(target, this)) {
        // The method was detached from its instance (passed on as a callback, destructured): `this`
        // is undefined, or what called it back (a Node Timeout, an emitter).
        const error = new LockConfigurationError(
          '@Locked',
          `${where}: called without its instance (this is ${describe(this)}): a method passed on as a callback or taken off its object loses it. Bind it (this.${String(propertyKey)}.bind(this)) or wrap the call (() => this.${String(propertyKey)}(...)).`,
        );
        return failed(spec, error);
      }
      const locks = this[LOCK_SERVICE];
      if (!locks) {
        const error = new LockConfigurationError(
          '@Locked',
          `${where}: no LockService on this instance. The class must be created by Nest (a provider or controller) in a module that imports LockModule, or LockModule must be global.`,
        );
        return failed(spec, error);
      }
      if (!(locks instanceof LockService)) {
        const error = new LockConfigurationError(
          '@Locked',
          `${where}: the LockService injected into this instance is not nestjs-locked's LockService but ${describeInjected(locks)}: a test replaced it (overrideProvider(LockService), a provider { provide: LockService, useValue }, or an automatic mock from useMocker()). ` +
            `@Locked needs the real one: import LockTestingModule.forRoot() in the test instead of a mock (the same LockService on an in-process store, no Redis needed).`,
        );
        return failed(spec, error);
      }
      const result = invokeLocked(locks, spec, this, args, method as (...a: unknown[]) => unknown);
      return site ? withLockErrorsTranslated(result, site.context, locks) : result;
    };
    // Whatever other decorators recorded on the method (route, @Cron, @MessagePattern, guards...)
    // stays visible on the wrapper, so @Locked may sit above or below them.
    for (const metadataKey of Reflect.getOwnMetadataKeys(method)) {
      Reflect.defineMetadata(metadataKey, Reflect.getOwnMetadata(metadataKey, method), lockedMethod);
    }
    Object.defineProperty(lockedMethod, 'name', { value: method.name });
    Reflect.defineMetadata(LOCKED_METADATA, spec, lockedMethod);
    descriptor.value = lockedMethod as never;

    if (!injected.has(target)) {
      injected.add(target);
      Inject(LockService)(target, LOCK_SERVICE);
    }
    if (siteIndex === undefined) UseInterceptors(LockInterceptor)(target, propertyKey, descriptor);
    return descriptor;
  };
}

function describeInjected(value: unknown): string {
  if (value === null || typeof value !== 'object') return typeof value;
  const name = (Object.getPrototypeOf(value) as { constructor?: { name?: string } } | null)?.constructor?.name;
  return name && name !== 'Object' ? `an instance of ${name}` : 'a plain object';
}

/** A call that fails before any lock is taken, in the shape the method returns. */
function failed(spec: LockedSpec, error: Error): unknown {
  if (spec.observable) return new Observable((s) => s.error(error));
  if (spec.asyncGenerator) {
    return (async function* () {
      throw error;
    })();
  }
  return Promise.reject(error);
}

function changedCallSite(where: string, index: number, value: unknown): LockConfigurationError {
  const got = value === null ? 'null' : typeof value === 'object' ? `an object (${(value as object).constructor?.name ?? 'no prototype'})` : typeof value;
  return new LockConfigurationError(
    '@Locked',
    `${where}: the parameter @Locked declares after the method's own (index ${index}, type 'custom', no metatype) reached the method as ${got}, not as the LockCallSite Nest filled in: a pipe changed it. ` +
      `A global or controller-wide pipe must return the value of a 'custom' parameter it does not know unchanged (check metadata.type), or lock failures could not be answered with 409 / 423 / 503 (README, "How it is built").`,
  );
}

function buildSpec(
  key: LockedKey,
  options: LockedOptions | undefined,
  where: string,
  target: object,
  propertyKey: string | symbol,
  asyncGenerator: boolean,
): LockedSpec {
  const validated = validateLockedOptions(options, where);
  const returnType: unknown = Reflect.getMetadata('design:returntype', target, propertyKey);
  const observable = returnType === Observable || (typeof returnType === 'function' && returnType.name === 'Observable');
  if (typeof key === 'function') {
    const keyFunction = key as (...args: unknown[]) => unknown;
    if (Object.getPrototypeOf(keyFunction) === ASYNC_FUNCTION) {
      // Its key would be a Promise: the lock is taken before the method runs, from the arguments alone.
      throw new LockConfigurationError('key', `${where}: the key function is async; it must return the key itself (a string, or an array of strings), not a Promise. Drop async, and look up what the key needs inside the method instead.`);
    }
    return {
      where,
      options: validated,
      observable,
      asyncGenerator,
      keyOf: (args, self) => {
        const value = keyFunction.apply(self, args as unknown[]);
        if (Array.isArray(value)) return canonicalKeys(value, `${where} (key function)`);
        assertLockKey(value, `${where} (key function)`);
        return value;
      },
    };
  }
  const paramTypes: unknown = Reflect.getMetadata('design:paramtypes', target, propertyKey);
  const declared = Array.isArray(paramTypes) ? paramTypes.length : undefined;
  if (Array.isArray(key)) {
    if (key.length === 0) throw new LockConfigurationError('template', `${where}: an array of key templates needs at least one template.`);
    // As a call's options are for a group (LockService.takeGroup), but now rather than at every call.
    exclusiveGroup(validated.fair, validated.mode, where);
    const templates = key.map((k: string) => LockKeyTemplate.parse(k, where, declared));
    return {
      where,
      options: validated,
      observable,
      asyncGenerator,
      keyOf: (args) => canonicalKeys(templates.map((t) => t.resolve(args)), where),
    };
  }
  const template = LockKeyTemplate.parse(key as string, where, declared);
  return { where, options: validated, observable, asyncGenerator, keyOf: (args) => template.resolve(args) };
}
