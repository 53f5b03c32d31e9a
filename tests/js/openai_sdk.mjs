// The official `openai` npm package against infertap: node tests/js/openai_sdk.mjs SCENARIO
import OpenAI from "openai";

import { API_KEY, BASE_URL, describeError, main, runTool } from "./common.mjs";

const client = new OpenAI({ baseURL: BASE_URL, apiKey: API_KEY, maxRetries: 0 });
const MODEL = "sim-model";

// A streamed chat completion, assembled as the SDK's users do; tool-call deltas merged by index.
async function streamChat(body, options = {}) {
  const stream = await client.chat.completions.create({ model: MODEL, ...body, stream: true }, options);
  let text = "";
  let deltas = 0;
  let finishReason = null;
  let usageChunks = 0;
  const calls = [];
  for await (const chunk of stream) {
    if (chunk.usage) usageChunks += 1;
    const choice = chunk.choices[0];
    if (!choice) continue;
    if (choice.delta.content) {
      text += choice.delta.content;
      deltas += 1;
    }
    for (const tc of choice.delta.tool_calls ?? []) {
      calls[tc.index] ??= { id: "", name: "", arguments: "" };
      if (tc.id) calls[tc.index].id = tc.id;
      if (tc.function?.name) calls[tc.index].name += tc.function.name;
      if (tc.function?.arguments) calls[tc.index].arguments += tc.function.arguments;
    }
    finishReason = choice.finish_reason ?? finishReason;
  }
  return { text, deltas, finishReason, usageChunks, calls };
}

// A streamed Responses API call: the text deltas, the function calls and the final response.
async function streamResponse(body, options = {}) {
  const stream = await client.responses.create({ model: MODEL, ...body, stream: true }, options);
  let text = "";
  let deltas = 0;
  let argumentDeltas = 0;
  let completed = null;
  for await (const event of stream) {
    if (event.type === "response.output_text.delta") {
      text += event.delta;
      deltas += 1;
    } else if (event.type === "response.function_call_arguments.delta") {
      argumentDeltas += 1;
    } else if (event.type === "response.completed") {
      completed = event.response;
    }
  }
  const calls = (completed?.output ?? []).filter((o) => o.type === "function_call");
  return { text, deltas, argumentDeltas, completed, calls };
}

const parsed = (calls) => calls.map((c) => ({ name: c.name, args: JSON.parse(c.arguments) }));
const responsesTools = (tools) =>
  tools.map(({ function: f }) => ({ type: "function", name: f.name, description: f.description, parameters: f.parameters }));

await main({
  async chat_stream({ prompt, seed }) {
    const messages = [{ role: "user", content: prompt }];
    const streamed = await streamChat({ messages, seed, temperature: 0 });
    const whole = await client.chat.completions.create({ model: MODEL, messages, seed, temperature: 0 });
    return {
      streamed: streamed.text,
      deltas: streamed.deltas,
      finishReason: streamed.finishReason,
      // Not asked for: the usage infertap asks the upstream for must not reach this client.
      usageChunks: streamed.usageChunks,
      streamOutputTokens: null,
      whole: whole.choices[0].message.content,
      wholeOutputTokens: whole.usage.completion_tokens,
      requests: 2,
    };
  },

  async responses_stream({ prompt }) {
    const streamed = await streamResponse({ input: prompt, temperature: 0 });
    const whole = await client.responses.create({ model: MODEL, input: prompt, temperature: 0 });
    return {
      streamed: streamed.text,
      deltas: streamed.deltas,
      status: streamed.completed?.status ?? null,
      streamOutputTokens: streamed.completed?.usage?.output_tokens ?? null,
      whole: whole.output_text,
      wholeOutputTokens: whole.usage.output_tokens,
      requests: 2,
    };
  },

  async chat_tools({ prompt, tools, cases }) {
    // One streamed request per case: {seed, tool_choice}; the calls come back to the caller.
    const out = [];
    for (const { seed, tool_choice } of cases) {
      const r = await streamChat({ messages: [{ role: "user", content: prompt }], tools, tool_choice, seed });
      out.push({ text: r.text, finishReason: r.finishReason, calls: parsed(r.calls) });
    }
    return { cases: out, requests: cases.length };
  },

  async chat_tool_loop({ prompt, tools }) {
    // The agent loop: the model must call a tool, the tool's result goes back, the model answers.
    const messages = [{ role: "user", content: prompt }];
    const first = await streamChat({ messages, tools, tool_choice: "required", temperature: 0 });
    messages.push({
      role: "assistant",
      content: null,
      tool_calls: first.calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } })),
    });
    const results = first.calls.map((c) => runTool(c.name, JSON.parse(c.arguments)));
    first.calls.forEach((c, i) => messages.push({ role: "tool", tool_call_id: c.id, content: JSON.stringify(results[i]) }));
    const second = await streamChat({ messages, tools, tool_choice: "auto", temperature: 0 });
    return {
      calls: parsed(first.calls),
      firstFinishReason: first.finishReason,
      results,
      text: second.text,
      finishReason: second.finishReason,
      secondCalls: second.calls.length,
      requests: 2,
    };
  },

  async responses_tool_loop({ prompt, tools }) {
    const rtools = responsesTools(tools);
    const input = [{ role: "user", content: prompt }];
    const first = await streamResponse({ input, tools: rtools, tool_choice: "required", temperature: 0 });
    const results = first.calls.map((c) => runTool(c.name, JSON.parse(c.arguments)));
    first.calls.forEach((c, i) => {
      input.push({ type: "function_call", call_id: c.call_id, name: c.name, arguments: c.arguments });
      input.push({ type: "function_call_output", call_id: c.call_id, output: JSON.stringify(results[i]) });
    });
    const second = await streamResponse({ input, tools: rtools, temperature: 0 });
    return {
      calls: parsed(first.calls),
      argumentDeltas: first.argumentDeltas,
      results,
      text: second.text,
      secondCalls: second.calls.length,
      requests: 2,
    };
  },

  async embeddings({ input }) {
    // The SDK asks for base64 unless told otherwise, and decodes it into floats.
    const r = await client.embeddings.create({ model: MODEL, input });
    return { vectors: r.data.map((d) => Array.from(d.embedding)), requests: 1 };
  },

  async abort({ prompt, headers, route }) {
    // Read the first output delta, then abort with an AbortController: infertap sees the client go.
    const controller = new AbortController();
    const options = { signal: controller.signal, headers };
    let deltas = 0;
    let error = null;
    try {
      const stream =
        route === "responses"
          ? await client.responses.create({ model: MODEL, input: prompt, stream: true }, options)
          : await client.chat.completions.create(
              { model: MODEL, messages: [{ role: "user", content: prompt }], stream: true },
              options,
            );
      for await (const event of stream) {
        const text = route === "responses" ? event.type === "response.output_text.delta" : event.choices[0]?.delta?.content;
        if (text) {
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
    // A stream that fails after its first output: the deltas before, then what the iteration threw.
    let text = "";
    let deltas = 0;
    let error = null;
    try {
      if (route === "responses") {
        for await (const event of await client.responses.create({ model, input: prompt, stream: true })) {
          if (event.type === "response.output_text.delta") {
            text += event.delta;
            deltas += 1;
          }
        }
      } else {
        const messages = [{ role: "user", content: prompt }];
        for await (const chunk of await client.chat.completions.create({ model, messages, stream: true })) {
          const content = chunk.choices[0]?.delta?.content;
          if (content) {
            text += content;
            deltas += 1;
          }
        }
      }
    } catch (err) {
      error = describeError(err);
    }
    return { text, deltas, errors: error ? [error] : [], requests: 1 };
  },

  async upstream_error({ prompt, model, temperature }) {
    // The upstream refuses before any output: each call must throw with the upstream's message.
    const messages = [{ role: "user", content: prompt }];
    const attempts = {
      "chat.completions/true": () => streamChat({ model, messages, temperature }),
      "chat.completions/false": () => client.chat.completions.create({ model, messages, temperature }),
      "responses/true": () => streamResponse({ model, input: prompt, temperature }),
    };
    const errors = {};
    for (const [key, attempt] of Object.entries(attempts)) {
      try {
        await attempt();
        errors[key] = null;
      } catch (err) {
        errors[key] = describeError(err);
      }
    }
    return { errors, requests: Object.keys(attempts).length };
  },
});
