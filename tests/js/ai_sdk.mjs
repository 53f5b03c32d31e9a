// The Vercel AI SDK (`ai` + `@ai-sdk/openai`) against infertap: node tests/js/ai_sdk.mjs SCENARIO
// openai.chat(id) speaks Chat Completions; openai(id), the SDK's default, speaks the Responses API.
import { createOpenAI } from "@ai-sdk/openai";
import { embed, generateText, jsonSchema, stepCountIs, streamText, tool } from "ai";

import { API_KEY, BASE_URL, describeError, main, runTool } from "./common.mjs";

// The SDK warns on the console about settings a provider ignores; stderr is for real failures.
globalThis.AI_SDK_LOG_WARNINGS = false;

const openai = createOpenAI({ baseURL: BASE_URL, apiKey: API_KEY });
const MODEL = "sim-model";
const providers = { chat: (model) => openai.chat(model), responses: (model) => openai(model) };

// The test's OpenAI-format tools as AI SDK tools, in the same order (the engine's draw depends on it).
// With `execute(name)` the SDK runs each call itself and sends its result back.
function sdkTools(tools, execute) {
  return Object.fromEntries(
    tools.map(({ function: f }) => [
      f.name,
      tool({
        description: f.description,
        inputSchema: jsonSchema(f.parameters),
        ...(execute && { execute: execute(f.name) }),
      }),
    ]),
  );
}

// A streamText result, part by part: error parts are how the SDK reports a failed stream.
async function consume(result) {
  let text = "";
  let deltas = 0;
  const calls = [];
  const errors = [];
  for await (const part of result.fullStream) {
    if (part.type === "text-delta") {
      text += part.text;
      deltas += 1;
    } else if (part.type === "tool-call") {
      calls.push({ name: part.toolName, args: part.input });
    } else if (part.type === "error") {
      errors.push(describeError(part.error));
    }
  }
  return { text, deltas, calls, errors };
}

async function streamAndWhole(api, { prompt, seed }) {
  const settings = { prompt, temperature: 0, maxRetries: 0, ...(seed !== undefined && { seed }) };
  const result = streamText({ model: providers[api](MODEL), ...settings });
  const streamed = await consume(result);
  if (streamed.errors.length) throw new Error(JSON.stringify(streamed.errors));
  const usage = await result.usage;
  const whole = await generateText({ model: providers[api](MODEL), ...settings });
  return {
    streamed: streamed.text,
    deltas: streamed.deltas,
    finishReason: await result.finishReason,
    streamOutputTokens: usage.outputTokens ?? null,
    whole: whole.text,
    wholeOutputTokens: whole.usage.outputTokens ?? null,
    requests: 2,
  };
}

// The agent loop, run by the SDK: the first step must call a tool, which the SDK executes and sends
// back; then the model answers in text. One request per step.
async function toolLoop(api, { prompt, tools }) {
  const results = [];
  const execute = (name) => async (args) => {
    const r = runTool(name, args);
    results.push(r);
    return r;
  };
  const result = streamText({
    model: providers[api](MODEL),
    prompt,
    tools: sdkTools(tools, execute),
    temperature: 0,
    maxRetries: 0,
    stopWhen: stepCountIs(4),
    prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "auto" }),
  });
  const streamed = await consume(result);
  if (streamed.errors.length) throw new Error(JSON.stringify(streamed.errors));
  const steps = await result.steps;
  return {
    calls: streamed.calls,
    results,
    text: streamed.text,
    stepFinishReasons: steps.map((s) => s.finishReason),
    secondCalls: steps.slice(1).reduce((n, s) => n + s.toolCalls.length, 0),
    requests: steps.length,
  };
}

await main({
  chat_stream: (spec) => streamAndWhole("chat", spec),
  responses_stream: (spec) => streamAndWhole("responses", spec),

  async chat_tools({ prompt, tools, cases }) {
    const out = [];
    for (const { seed, tool_choice } of cases) {
      const result = streamText({
        model: openai.chat(MODEL),
        prompt,
        tools: sdkTools(tools), // no execute: the calls come back to the caller
        toolChoice: tool_choice,
        seed,
        maxRetries: 0,
      });
      const r = await consume(result);
      if (r.errors.length) throw new Error(JSON.stringify(r.errors));
      out.push({ text: r.text, finishReason: await result.finishReason, calls: r.calls });
    }
    return { cases: out, requests: cases.length };
  },

  chat_tool_loop: (spec) => toolLoop("chat", spec),
  responses_tool_loop: (spec) => toolLoop("responses", spec),

  async embeddings({ input }) {
    const r = await embed({ model: openai.embedding(MODEL), value: input, maxRetries: 0 });
    return { vectors: [r.embedding], requests: 1 };
  },

  async abort({ prompt, headers, route }) {
    const controller = new AbortController();
    let deltas = 0;
    let error = null;
    try {
      const result = streamText({
        model: providers[route ?? "chat"](MODEL),
        prompt,
        headers,
        maxRetries: 0,
        abortSignal: controller.signal,
      });
      for await (const part of result.fullStream) {
        if (part.type === "text-delta" && part.text) {
          deltas += 1;
          controller.abort();
        }
      }
    } catch (err) {
      error = describeError(err);
    }
    return { deltas, aborted: controller.signal.aborted, error, requests: 1 };
  },

  async stream_failure({ prompt, model, route }) {
    // streamText reports a failed stream as an error part; anything thrown as well is a finding.
    const result = streamText({ model: providers[route](model), prompt, maxRetries: 0, onError: () => {} });
    const { text, deltas, errors } = await consume(result);
    return { text, deltas, errors, finishReason: await result.finishReason, requests: 1 };
  },

  async upstream_error({ prompt, model, temperature }) {
    const errors = {};
    for (const [api, route] of [["chat", "chat.completions"], ["responses", "responses"]]) {
      const settings = { model: providers[api](model), prompt, temperature, maxRetries: 0 };
      // streamText reports the failure as an error part (and to onError); generateText throws it.
      const streamed = await consume(streamText({ ...settings, onError: () => {} }));
      errors[`${route}/true`] = streamed.errors[0] ?? null;
      try {
        await generateText(settings);
        errors[`${route}/false`] = null;
      } catch (err) {
        errors[`${route}/false`] = describeError(err);
      }
    }
    return { errors, requests: 4 };
  },
});
