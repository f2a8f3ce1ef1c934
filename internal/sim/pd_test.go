package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/poll"
)

const chatBody = `{"model":"m","messages":[{"role":"user","content":"tell me about relays"}],"max_tokens":6}`

// prefillProbe is what a gateway sends a NIXL prefill: one token, not streamed, tagged.
func prefillProbe(body, kv string) string {
	var m map[string]any
	json.Unmarshal([]byte(body), &m)
	m["max_tokens"], m["stream"], m["ignore_eos"] = 1, false, true
	delete(m, "stream_options")
	var p any
	json.Unmarshal([]byte(kv), &p)
	m["kv_transfer_params"] = p
	return mustJSON(m)
}

func withKV(body string, kv any) string {
	var m map[string]any
	json.Unmarshal([]byte(body), &m)
	m["kv_transfer_params"] = kv
	return mustJSON(m)
}

func nixlPair(t *testing.T, prefill, decode Config) (*Engine, *Engine) {
	prefill.Engine, prefill.Role, prefill.KVConnector, prefill.Model = EngineVLLM, RolePrefill, ConnectorNixl, "m"
	decode.Engine, decode.Role, decode.KVConnector, decode.Model = EngineVLLM, RoleDecode, ConnectorNixl, "m"
	return start(t, prefill), start(t, decode)
}

// A NIXL prefill→decode pair driven by hand gives the aggregated text with the KV reported as
// remote; decode without params gives the same text but reports recompute.
func TestNixlHandDrivenPair(t *testing.T) {
	p, d := nixlPair(t, Config{EngineID: "P"}, Config{})
	agg := start(t, Config{Model: "m"})
	want := chatText(post(t, agg.URL()+"/v1/chat/completions", chatBody))

	pr := post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true,"do_remote_prefill":false}`))
	kv, _ := path(pr.json, "kv_transfer_params").(map[string]any)
	if pr.status != 200 || kv == nil {
		t.Fatalf("prefill: %d %s", pr.status, pr.raw)
	}
	for _, k := range []string{"do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids", "remote_request_id", "remote_host", "remote_port", "tp_size"} {
		if _, ok := kv[k]; !ok {
			t.Errorf("kv_transfer_params lacks %s: %v", k, kv)
		}
	}
	if kv["do_remote_prefill"] != true || kv["do_remote_decode"] != false || kv["remote_engine_id"] != "P" {
		t.Errorf("kv params %v", kv)
	}
	if s := p.Stats(); s.HandoffsPinned != 1 || len(p.kv.list()) != 1 {
		t.Fatalf("pinned %d, list %d", s.HandoffsPinned, len(p.kv.list()))
	}
	if dbg := get(t, p.URL()+"/debug/kv"); len(path(dbg.json, "pinned").([]any)) != 1 {
		t.Errorf("/debug/kv %s", dbg.raw)
	}

	dr := post(t, d.URL()+"/v1/chat/completions", withKV(chatBody, kv))
	if dr.status != 200 || chatText(dr) != want {
		t.Fatalf("decode: %d %q, want %q", dr.status, chatText(dr), want)
	}
	prompt := num(path(dr.json, "usage", "prompt_tokens"))
	if dr.header.Get(HeaderKVSource) != SourceRemote || num(path(dr.json, "usage", "prompt_tokens_details", "cached_tokens")) != prompt-1 {
		t.Errorf("decode source %q cached %v (prompt %d)", dr.header.Get(HeaderKVSource), path(dr.json, "usage", "prompt_tokens_details", "cached_tokens"), prompt)
	}
	if ps, ds := p.Stats(), d.Stats(); ps.HandoffsPulled != 1 || len(p.kv.list()) != 0 || ds.PromptTokensRemote != int64(prompt-1) {
		t.Errorf("after pull: prefill %+v, decode %+v", ps, ds)
	}
	if !strings.Contains(get(t, d.URL()+"/metrics").raw, fmt.Sprintf(`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} %d`, prompt-1)) {
		t.Error("decode metrics do not show the remote tokens")
	}

	plain := post(t, d.URL()+"/v1/chat/completions", chatBody)
	if chatText(plain) != want || plain.header.Get(HeaderKVSource) != SourceRecompute || num(path(plain.json, "usage", "prompt_tokens_details", "cached_tokens")) != 0 {
		t.Errorf("decode without params: %q source %q", chatText(plain), plain.header.Get(HeaderKVSource))
	}
}

func TestNixlNoParamsWhenStreamedOrStopped(t *testing.T) {
	p, _ := nixlPair(t, Config{}, Config{})
	tag := `{"do_remote_decode":true,"do_remote_prefill":false}`
	streamed := post(t, p.URL()+"/v1/chat/completions", withKV(`{"messages":[{"role":"user","content":"x y"}],"max_tokens":1,"stream":true}`, json.RawMessage(tag)))
	if strings.Contains(streamed.raw, "kv_transfer_params") || p.Stats().HandoffsPinned != 0 {
		t.Errorf("streamed prefill pinned or returned params: %s", streamed.raw)
	}
	natural, _ := expected("x y", Sampling{})
	stopped := post(t, p.URL()+"/v1/chat/completions", withKV(`{"messages":[{"role":"user","content":"x y"}],"max_tokens":1,"stop":["`+strings.Fields(natural)[0]+`"]}`, json.RawMessage(tag)))
	if path(stopped.json, "kv_transfer_params") != nil || p.Stats().HandoffsPinned != 0 {
		t.Errorf("prefill finished by stop returned params: %s", stopped.raw)
	}
}

func TestNixlExpiredOrUnknownHandoff(t *testing.T) {
	p, failing := nixlPair(t, Config{KVTimeout: 50 * time.Millisecond}, Config{})
	recomputing := start(t, Config{Engine: EngineVLLM, Role: RoleDecode, Model: "m", KVLoadFailure: PolicyRecompute})
	kv := path(post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true}`)).json, "kv_transfer_params")
	poll.Until(t, "the condition", func() bool { return p.Stats().HandoffsExpired == 1 })
	if r := post(t, failing.URL()+"/v1/chat/completions", withKV(chatBody, kv)); r.status != 500 || !strings.Contains(r.raw, "KV load failed") {
		t.Errorf("expired handoff with policy fail: %d %s", r.status, r.raw)
	}
	r := post(t, recomputing.URL()+"/v1/chat/completions", withKV(chatBody, kv))
	if r.status != 200 || r.header.Get(HeaderKVSource) != SourceRecompute || recomputing.Stats().KVLoadFailures != 1 {
		t.Errorf("expired handoff with policy recompute: %d %q", r.status, r.header.Get(HeaderKVSource))
	}
	// Params for a different prompt are a load failure, not a silent success.
	kv2 := path(post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true}`)).json, "kv_transfer_params")
	other := `{"model":"m","messages":[{"role":"user","content":"something else entirely"}],"max_tokens":6}`
	if r := post(t, failing.URL()+"/v1/chat/completions", withKV(other, kv2)); r.status != 500 {
		t.Errorf("KV for another prompt: %d %s", r.status, r.raw)
	}
}

func TestMooncake(t *testing.T) {
	p := start(t, Config{Engine: EngineVLLM, Role: RolePrefill, KVConnector: ConnectorMooncake, Model: "m", EngineID: "mc", BootstrapTimeout: 2 * time.Second})
	d := start(t, Config{Engine: EngineVLLM, Role: RoleDecode, KVConnector: ConnectorMooncake, Model: "m", BootstrapTimeout: 2 * time.Second})
	agg := start(t, Config{Model: "m"})
	want := chatText(post(t, agg.URL()+"/v1/chat/completions", chatBody))
	if q := get(t, fmt.Sprintf("http://127.0.0.1:%d/query", p.BootstrapPort())); path(q.json, "0", "engine_id") != "mc" {
		t.Fatalf("bootstrap /query %s", q.raw)
	}
	boot := fmt.Sprintf("http://127.0.0.1:%d", p.BootstrapPort())
	decodeKV := func(id, engine string) map[string]any {
		return map[string]any{"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": id, "remote_engine_id": engine, "remote_bootstrap_addr": boot}
	}
	// Decode first: it waits for the prefill.
	var wg sync.WaitGroup
	var dr reply
	wg.Go(func() { dr = post(t, d.URL()+"/v1/chat/completions", withKV(chatBody, decodeKV("xfer-1", "mc"))) })
	time.Sleep(50 * time.Millisecond)
	pr := post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-1"}`))
	wg.Wait()
	if pr.status != 200 || path(pr.json, "kv_transfer_params") != nil {
		t.Errorf("mooncake prefill: %d %s", pr.status, pr.raw)
	}
	if dr.status != 200 || chatText(dr) != want || dr.header.Get(HeaderKVSource) != SourceRemote {
		t.Errorf("mooncake decode: %d %q %q", dr.status, chatText(dr), dr.header.Get(HeaderKVSource))
	}
	// Wrong engine id fails.
	post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true,"transfer_id":"xfer-2"}`))
	if r := post(t, d.URL()+"/v1/chat/completions", withKV(chatBody, decodeKV("xfer-2", "wrong"))); r.status != 500 {
		t.Errorf("wrong engine id: %d %s", r.status, r.raw)
	}
	// A prefill that never comes: the decode gives up after its timeout.
	if r := post(t, d.URL()+"/v1/chat/completions", withKV(chatBody, decodeKV("xfer-never", "mc"))); r.status != 500 {
		t.Errorf("missing prefill: %d", r.status)
	}
	// No transfer_id on the prefill: nothing pinned.
	before := p.Stats().HandoffsPinned
	post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true}`))
	if p.Stats().HandoffsPinned != before {
		t.Error("prefill without transfer_id pinned KV")
	}
}

func TestDataParallel(t *testing.T) {
	p, d := nixlPair(t, Config{EngineID: "P", DPSize: 2}, Config{})
	if ids := p.EngineIDs(); len(ids) != 2 || ids[0] != "P_dp0" || ids[1] != "P_dp1" {
		t.Fatalf("engine ids %v", ids)
	}
	r := post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true}`), "X-data-parallel-rank", "1")
	kv := path(r.json, "kv_transfer_params").(map[string]any)
	if kv["remote_engine_id"] != "P_dp1" || r.header.Get(HeaderDPRank) != "1" || num(kv["remote_port"]) != p.sidePorts[1] {
		t.Errorf("rank 1: %v header %q", kv, r.header.Get(HeaderDPRank))
	}
	if dr := post(t, d.URL()+"/v1/chat/completions", withKV(chatBody, kv)); dr.header.Get(HeaderKVSource) != SourceRemote {
		t.Errorf("decode from rank 1: %d %s", dr.status, dr.raw)
	}
	if r := post(t, p.URL()+"/v1/chat/completions", chatBody, "X-data-parallel-rank", "2"); r.status != 400 || !strings.Contains(r.raw, "out of range") {
		t.Errorf("rank 2 of 2: %d %s", r.status, r.raw)
	}
	s := start(t, Config{Engine: EngineSGLang, Model: "m", DPSize: 2})
	if r := post(t, s.URL()+"/generate", `{"text":"a","routed_dp_rank":5}`); r.status != 400 {
		t.Errorf("sglang routed_dp_rank 5: %d", r.status)
	}
}

func sglangPair(t *testing.T, pc, dc Config) (*Engine, *Engine) {
	pc.Engine, pc.Role, pc.Model = EngineSGLang, RolePrefill, "m"
	dc.Engine, dc.Role, dc.Model = EngineSGLang, RoleDecode, "m"
	if pc.BootstrapTimeout == 0 {
		pc.BootstrapTimeout = 3 * time.Second
	}
	if dc.BootstrapTimeout == 0 {
		dc.BootstrapTimeout = 3 * time.Second
	}
	return start(t, pc), start(t, dc)
}

func withBoot(body string, p *Engine, rooms any) string {
	var m map[string]any
	json.Unmarshal([]byte(body), &m)
	m["bootstrap_host"], m["bootstrap_port"], m["bootstrap_room"] = "127.0.0.1", p.BootstrapPort(), rooms
	return mustJSON(m)
}

// both sends the same body to prefill and decode at once, as the SGLang protocol requires.
func both(t *testing.T, p, d *Engine, route, body string) (pr, dr reply) {
	var wg sync.WaitGroup
	wg.Go(func() { pr = post(t, p.URL()+route, body) })
	wg.Go(func() { dr = post(t, d.URL()+route, body) })
	wg.Wait()
	return pr, dr
}

func TestSGLangRendezvous(t *testing.T) {
	p, d := sglangPair(t, Config{}, Config{})
	agg := start(t, Config{Engine: EngineSGLang, Model: "m"})
	for _, tc := range []struct{ route, body string }{
		{"/v1/chat/completions", chatBody},
		{"/v1/completions", `{"model":"m","prompt":"a b c d","max_tokens":5}`},
		{"/generate", `{"text":"a b c d","sampling_params":{"max_new_tokens":5}}`},
	} {
		want := post(t, agg.URL()+tc.route, tc.body).raw
		pr, dr := both(t, p, d, tc.route, withBoot(tc.body, p, 12345))
		if pr.status != 200 || dr.status != 200 {
			t.Fatalf("%s: prefill %d %s decode %d %s", tc.route, pr.status, pr.raw, dr.status, dr.raw)
		}
		if dr.header.Get(HeaderKVSource) != SourceRemote {
			t.Errorf("%s: decode source %q", tc.route, dr.header.Get(HeaderKVSource))
		}
		if tc.route == "/generate" {
			if path(pr.json, "meta_info", "finish_reason", "length") != json.Number("0") || num(path(pr.json, "meta_info", "completion_tokens")) != 1 {
				t.Errorf("prefill leg: %s", pr.raw)
			}
			var a map[string]any
			json.Unmarshal([]byte(want), &a)
			if path(dr.json, "text") != a["text"] {
				t.Errorf("decode text %v, aggregated %v", path(dr.json, "text"), a["text"])
			}
		}
	}
	// Batch: one room per item.
	pr, dr := both(t, p, d, "/generate", withBoot(`{"text":["a b","c d e"],"sampling_params":{"max_new_tokens":3}}`, p, []uint64{7, 8}))
	if pr.status != 200 || dr.status != 200 || strings.Count(dr.raw, `"text"`) != 2 {
		t.Errorf("batch: %d %s / %d %s", pr.status, pr.raw, dr.status, dr.raw)
	}
	// Fake bootstrap host (SGLang's own health check): no pairing.
	h := post(t, p.URL()+"/generate", `{"text":"a","bootstrap_host":"2.2.2.2","bootstrap_room":0,"sampling_params":{"max_new_tokens":1}}`)
	if h.status != 200 {
		t.Errorf("fake host: %d %s", h.status, h.raw)
	}
}

func TestSGLangLogprobSplit(t *testing.T) {
	p, d := sglangPair(t, Config{}, Config{})
	agg := start(t, Config{Engine: EngineSGLang, Model: "m"})
	body := `{"text":"a b c d e","sampling_params":{"max_new_tokens":3},"return_logprob":true}`
	a := post(t, agg.URL()+"/generate", body)
	pr, dr := both(t, p, d, "/generate", withBoot(body, p, 99))
	pin := path(pr.json, "meta_info", "input_token_logprobs").([]any)
	din := path(dr.json, "meta_info", "input_token_logprobs").([]any)
	ain := path(a.json, "meta_info", "input_token_logprobs").([]any)
	if len(pin) == 0 || len(din) == 0 || mustJSON(append(pin, din...)) != mustJSON(ain) {
		t.Errorf("prefill %v ++ decode %v != aggregated %v", pin, din, ain)
	}
}

func TestSGLangPartnerNeverArrives(t *testing.T) {
	p, d := sglangPair(t, Config{BootstrapTimeout: 200 * time.Millisecond}, Config{BootstrapTimeout: 200 * time.Millisecond})
	if r := post(t, p.URL()+"/generate", withBoot(`{"text":"a"}`, p, 1)); r.status != 500 || !strings.Contains(r.raw, "KVPoll.Bootstrapping") {
		t.Errorf("prefill alone: %d %s", r.status, r.raw)
	}
	if r := post(t, d.URL()+"/generate", withBoot(`{"text":"a"}`, p, 2)); r.status != 500 || !strings.Contains(r.raw, "WaitingForInput") {
		t.Errorf("decode alone: %d %s", r.status, r.raw)
	}
	// A decode whose client leaves is counted as cancelled, and the room is gone.
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", d.URL()+"/generate", strings.NewReader(withBoot(`{"text":"a"}`, p, 3)))
	go func() { // cancel once the decode has the request (it then waits 200 ms for its partner)
		for start := time.Now(); d.Stats().RequestsReceived < 2 && time.Since(start) < 10*time.Second; {
			time.Sleep(time.Millisecond)
		}
		cancel()
	}()
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
	}
	poll.Until(t, "the condition", func() bool { return d.Stats().RequestsCancelled == 1 })
}

func TestSGLangDPRooms(t *testing.T) {
	p, d := sglangPair(t, Config{DPSize: 2}, Config{})
	// A routed rank that disagrees with the room (10 % 2 = 0) is a follow_bootstrap_room conflict.
	if r := post(t, p.URL()+"/generate", strings.Replace(withBoot(`{"text":"a b"}`, p, 10), "{", `{"routed_dp_rank":1,`, 1)); r.status != 400 {
		t.Errorf("conflicting routed_dp_rank: %d %s", r.status, r.raw)
	}
	// Prefill pinned to rank 1, room 11 (11 % 2 = 1); decode told so: they meet.
	body := withBoot(`{"text":"a b","sampling_params":{"max_new_tokens":2}}`, p, 11)
	var wg sync.WaitGroup
	var pr, dr reply
	wg.Go(func() { pr = post(t, p.URL()+"/generate", strings.Replace(body, "{", `{"routed_dp_rank":1,`, 1)) })
	wg.Go(func() {
		dr = post(t, d.URL()+"/generate", strings.Replace(body, "{", `{"disagg_prefill_dp_rank":1,`, 1))
	})
	wg.Wait()
	if pr.status != 200 || dr.status != 200 || pr.header.Get(HeaderDPRank) != "1" {
		t.Errorf("rank 1 pair: %d %s / %d %s", pr.status, pr.raw, dr.status, dr.raw)
	}
}

func TestFaultsAndQueue(t *testing.T) {
	e := start(t, Config{Model: "m", MaxConcurrency: 1, QueueSize: 1})
	if r := post(t, e.URL()+"/v1/chat/completions", chatBody, HeaderFault, "status=503"); r.status != 503 || path(r.json, "error", "message") == nil {
		t.Errorf("injected 503: %d %s", r.status, r.raw)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", e.URL()+"/v1/chat/completions", strings.NewReader(chatBody))
	req.Header.Set(HeaderFault, "hang")
	if _, err := http.DefaultClient.Do(req); err == nil {
		t.Error("hang: got an answer")
	}
	// drop-after: the stream breaks after 2 events.
	resp, err := http.Post(e.URL()+"/v1/chat/completions", "application/json", strings.NewReader(`{"messages":[{"role":"user","content":"x"}],"max_tokens":8,"stream":true}`))
	if err == nil {
		resp.Body.Close()
	}
	req2, _ := http.NewRequest("POST", e.URL()+"/v1/chat/completions", strings.NewReader(`{"messages":[{"role":"user","content":"x"}],"max_tokens":8,"stream":true}`))
	req2.Header.Set(HeaderFault, "drop-after=2")
	resp, err = http.DefaultClient.Do(req2)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1<<16)
	n, rerr := readAllErr(resp, b)
	if rerr == nil || strings.Count(string(b[:n]), "data: ") != 2 {
		t.Errorf("drop-after=2: read %q err %v", b[:n], rerr)
	}
	// hang-after: the stream goes silent after 2 events, its connection open until the client leaves.
	hctx, hcancel := context.WithCancel(context.Background())
	defer hcancel()
	req3, _ := http.NewRequestWithContext(hctx, "POST", e.URL()+"/v1/chat/completions", strings.NewReader(`{"messages":[{"role":"user","content":"x"}],"max_tokens":8,"stream":true}`))
	req3.Header.Set(HeaderFault, "hang-after=2")
	resp, err = http.DefaultClient.Do(req3)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	go func() {
		n, _ := readAllErr(resp, b)
		got <- string(b[:n])
	}()
	select {
	case s := <-got:
		t.Errorf("hang-after=2: the stream ended: %q", s)
	case <-time.After(300 * time.Millisecond):
	}
	hcancel()
	if s := <-got; strings.Count(s, "data: ") != 2 {
		t.Errorf("hang-after=2: read %q", s)
	}
	// Queue: one running (slow), one waiting, the third is refused.
	slow := Config{Model: "m", MaxConcurrency: 1, QueueSize: 1, DecodePerToken: 100 * time.Millisecond}
	q := start(t, slow)
	var wg sync.WaitGroup
	for i := 0; i < 2; i++ {
		wg.Go(func() {
			post(t, q.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":3}`)
		})
	}
	poll.Until(t, "the condition", func() bool { return q.running.Load() == 1 && q.waiting.Load() == 1 })
	if r := post(t, q.URL()+"/v1/chat/completions", chatBody); r.status != 503 || !strings.Contains(r.raw, "queue is full") {
		t.Errorf("queue full: %d %s", r.status, r.raw)
	}
	wg.Wait()
}

func readAllErr(resp *http.Response, b []byte) (int, error) {
	defer resp.Body.Close()
	n := 0
	for {
		m, err := resp.Body.Read(b[n:])
		n += m
		if err != nil {
			if err.Error() == "EOF" {
				return n, nil
			}
			return n, err
		}
	}
}

func TestFaultRate(t *testing.T) {
	e := start(t, Config{Model: "m", Faults: Faults{Status: 500, Rate: 0.5}})
	failed := 0
	for i := 0; i < 200; i++ {
		if post(t, e.URL()+"/v1/completions", `{"prompt":"a","max_tokens":1}`).status == 500 {
			failed++
		}
	}
	// Binomial(200, 0.5): outside [60, 140] has probability below 1e-8.
	if failed < 60 || failed > 140 {
		t.Errorf("%d of 200 failed at rate 0.5", failed)
	}
}

// Some prompts end at their first token (EOS), as a real model's can: a prefill probe without
// ignore_eos then ends by stop, and the engine keeps no KV and returns no params. A gateway whose
// probe forgot ignore_eos fails here.
func TestProbeWithoutIgnoreEOSLosesTheHandoff(t *testing.T) {
	p, _ := nixlPair(t, Config{EngineID: "P"}, Config{})
	if _, finish := expected("tell me about relays", Sampling{MaxTokens: 1}); finish != FinishStop {
		t.Fatal("the test prompt does not end at its first token")
	}
	lenient := strings.Replace(prefillProbe(chatBody, `{"do_remote_decode":true}`), `"ignore_eos":true`, `"ignore_eos":false`, 1)
	r := post(t, p.URL()+"/v1/chat/completions", lenient)
	if kv := path(r.json, "kv_transfer_params"); r.status != 200 || kv != nil || path(r.json, "choices", 0, "finish_reason") != "stop" {
		t.Errorf("a probe without ignore_eos: %d %s", r.status, r.raw)
	}
	r = post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true}`))
	if kv := path(r.json, "kv_transfer_params"); r.status != 200 || kv == nil {
		t.Errorf("a probe with ignore_eos: %d %s", r.status, r.raw)
	}
}

// A streamed decode whose KV cannot be loaded answers 200 and reports the failure inside the
// stream, as vLLM does once the stream's head is out.
func TestNixlStreamedLoadFailureIsInBand(t *testing.T) {
	p, d := nixlPair(t, Config{KVTimeout: 50 * time.Millisecond}, Config{})
	kv := path(post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true}`)).json, "kv_transfer_params")
	poll.Until(t, "the condition", func() bool { return p.Stats().HandoffsExpired == 1 })
	streamed := strings.Replace(withKV(chatBody, kv), `{`, `{"stream":true,`, 1)
	r := post(t, d.URL()+"/v1/chat/completions", streamed)
	if r.status != 200 || !strings.HasPrefix(r.raw, `data: {"error":{`) || !strings.Contains(r.raw, `"code":500`) || !strings.HasSuffix(r.raw, "data: [DONE]\n\n") {
		t.Errorf("%d %q", r.status, r.raw)
	}
}

// A decode that refuses a request tells its prefill to free the KV at once; a later read of it
// succeeds from freed blocks, and the answer differs from the prompt's own.
func TestNixlRefusalFreesTheKV(t *testing.T) {
	p, d := nixlPair(t, Config{}, Config{})
	busy := start(t, Config{Engine: EngineVLLM, Role: RoleDecode, Model: "m", Faults: Faults{Status: 503}})
	want := post(t, d.URL()+"/v1/chat/completions", withKV(chatBody, path(post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true}`)).json, "kv_transfer_params")))
	kv := path(post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true}`)).json, "kv_transfer_params")
	if r := post(t, busy.URL()+"/v1/chat/completions", withKV(chatBody, kv)); r.status != 503 {
		t.Fatalf("busy decode: %d", r.status)
	}
	if s := p.Stats(); s.HandoffsReleased != 1 {
		t.Fatalf("released %d handoffs, want 1", s.HandoffsReleased)
	}
	r := post(t, d.URL()+"/v1/chat/completions", withKV(chatBody, kv))
	if r.status != 200 || r.header.Get(HeaderKVSource) != SourceRemote || p.Stats().StaleKVReads != 1 {
		t.Fatalf("read of freed KV: %d %q, %d stale reads", r.status, r.header.Get(HeaderKVSource), p.Stats().StaleKVReads)
	}
	content := func(raw string) string {
		_, after, _ := strings.Cut(raw, `"content":`)
		before, _, _ := strings.Cut(after, `,"`)
		return before
	}
	if got, own := content(r.raw), content(want.raw); got == "" || got == own {
		t.Errorf("an answer built on freed blocks, %s, equals the prompt's own, %s", got, own)
	}
}

// SGLang servers in either disaggregation mode refuse a request without a room, in SGLang's
// words; a decode given the warm-up host decodes on KV nothing filled: another text than the
// prompt's own (docs/ENGINES.md).
func TestSGLangDisaggregatedServersNeedARoom(t *testing.T) {
	p, d := sglangPair(t, Config{}, Config{})
	agg := start(t, Config{Engine: EngineSGLang, Model: "m"})
	body := `{"model":"m","prompt":"a b c d","max_tokens":5,"ignore_eos":true}`
	for name, e := range map[string]*Engine{"prefill": p, "decode": d} {
		r := post(t, e.URL()+"/v1/completions", body)
		if r.status != 400 || !strings.Contains(r.raw, "Disaggregated request received without bootstrap room id") {
			t.Errorf("%s without a room: %d %s", name, r.status, r.raw)
		}
	}
	want := post(t, agg.URL()+"/v1/completions", body)
	fake := post(t, d.URL()+"/v1/completions", `{"model":"m","prompt":"a b c d","max_tokens":5,"ignore_eos":true,"bootstrap_host":"2.2.2.2","bootstrap_room":0}`)
	if fake.status != 200 || path(fake.json, "choices", 0, "text") == path(want.json, "choices", 0, "text") {
		t.Errorf("a decode given the warm-up host answered %d %s; the prompt's own answer is %s", fake.status, fake.raw, want.raw)
	}
}

// With SameProcessKV a decode engine takes the KV of a prefill engine of this process by a call:
// the handoff works with the prefill's side channel shut, and it keeps the side channel's rules
// (the engine id must match, KV is taken once, a wrong prompt is a load failure).
func TestNixlSameProcessTakeKeepsTheHandoffsRules(t *testing.T) {
	p, d := nixlPair(t, Config{EngineID: "P"}, Config{SameProcessKV: true})
	for _, s := range p.side {
		s.Close() // an HTTP pull would now fail
	}
	probe := func() map[string]any {
		kv, _ := path(post(t, p.URL()+"/v1/chat/completions", prefillProbe(chatBody, `{"do_remote_decode":true}`)).json, "kv_transfer_params").(map[string]any)
		if kv == nil {
			t.Fatal("prefill returned no kv_transfer_params")
		}
		return kv
	}
	kv := probe()
	r := post(t, d.URL()+"/v1/chat/completions", withKV(chatBody, kv))
	if r.status != 200 || r.header.Get(HeaderKVSource) != SourceRemote || p.Stats().HandoffsPulled != 1 {
		t.Fatalf("same-process take: %d source %q, pulled %d: %s", r.status, r.header.Get(HeaderKVSource), p.Stats().HandoffsPulled, r.raw)
	}
	// Taken once: the same params again read freed blocks, as over the side channel.
	if r := post(t, d.URL()+"/v1/chat/completions", withKV(chatBody, kv)); r.status != 200 || p.Stats().StaleKVReads != 1 {
		t.Errorf("second take: %d, stale reads %d", r.status, p.Stats().StaleKVReads)
	}
	wrong := probe()
	wrong["remote_engine_id"] = "Q"
	if r := post(t, d.URL()+"/v1/chat/completions", withKV(chatBody, wrong)); r.status != 500 || !strings.Contains(r.raw, "belongs to engine") {
		t.Errorf("another engine's id: %d %s", r.status, r.raw)
	}
	other := `{"model":"m","messages":[{"role":"user","content":"something else entirely"}],"max_tokens":6}`
	if r := post(t, d.URL()+"/v1/chat/completions", withKV(other, probe())); r.status != 500 || d.Stats().KVLoadFailures != 2 {
		t.Errorf("KV for another prompt: %d, load failures %d: %s", r.status, d.Stats().KVLoadFailures, r.raw)
	}
	// Without the option, the decode pulls over the side channel, which is shut.
	overHTTP := start(t, Config{Engine: EngineVLLM, Role: RoleDecode, KVConnector: ConnectorNixl, Model: "m"})
	if r := post(t, overHTTP.URL()+"/v1/chat/completions", withKV(chatBody, probe())); r.status != 500 {
		t.Errorf("pull over a shut side channel: %d %s", r.status, r.raw)
	}
	// A closed prefill is no longer found.
	p.Close()
	if _, ok := sameProcess.Load(netJoin(p.cfg.Host, p.sidePorts[0])); ok {
		t.Error("a closed prefill engine is still registered")
	}
}
