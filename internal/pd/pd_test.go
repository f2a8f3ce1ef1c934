package pd

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/worker"
)

func req(path, body string) *Request {
	r, err := openai.ParseRequest([]byte(body))
	if err != nil {
		panic(err)
	}
	return &Request{Request: r, Path: path}
}

func TestBatchSize(t *testing.T) {
	for _, tc := range []struct {
		path, body string
		want       int
	}{
		{"/generate", `{"text":"a"}`, 0},
		{"/generate", `{"text":["a","b","c"]}`, 3},
		{"/generate", `{"input_ids":[1,2,3]}`, 0},
		{"/generate", `{"input_ids":[[1],[2]]}`, 2},
		{"/v1/completions", `{"prompt":"a"}`, 0},
		{"/v1/completions", `{"prompt":["a","b"]}`, 2},
		{"/v1/completions", `{"prompt":[1,2,3]}`, 0}, // one tokenized prompt, not a batch
		{"/v1/completions", `{"prompt":[[1,2],[3]]}`, 2},
		{"/v1/chat/completions", `{"n":4}`, 0}, // samples, not prompts: SamplesOf
		{"/generate", `{"text":[ "a" , "b" ]}`, 2},
		{"/generate", `{"text":[]}`, 0},
		{"/v1/completions", `{"prompt":[["a"],"b"]}`, 2},
		{"/v1/completions", `{"prompt_embeds":"QUFB"}`, 0}, // one tensor
		{"/v1/completions", `{"prompt_embeds":["QUFB","QkJC"]}`, 2},
		{"/v1/completions", `{"prompt":"a","prompt_embeds":["QUFB"]}`, 1},
		{"/v1/completions", `{"prompt":["a","b"],"prompt_embeds":["QUFB"]}`, 3},
	} {
		if got := BatchSize(req(tc.path, tc.body), 1<<20); got != tc.want {
			t.Errorf("BatchSize(%s %s) = %d, want %d", tc.path, tc.body, got, tc.want)
		}
	}
}

func TestSamplesOf(t *testing.T) {
	for _, tc := range []struct {
		path, body string
		want       int
	}{
		{"/v1/chat/completions", `{"n":4}`, 4},
		{"/v1/completions", `{"prompt":"a"}`, 1},
		{"/generate", `{"text":"a","sampling_params":{"n":3,"max_new_tokens":2}}`, 3},
		{"/generate", `{"text":"a","n":5}`, 1}, // /generate reads sampling_params.n only
		{"/generate", `{"text":"a","sampling_params":{"n":"3"}}`, 1},
		{"/generate", `{"text":"a","sampling_params":null}`, 1},
		// SGLang's list form, one per prompt: the most any asks.
		{"/generate", `{"text":["a","b"],"sampling_params":[{"n":2},{"n":4,"max_new_tokens":2}]}`, 4},
		{"/generate", `{"text":["a"],"sampling_params":[{"max_new_tokens":2}]}`, 1},
	} {
		r := req(tc.path, tc.body)
		if got := SamplesOf(r); got != tc.want {
			t.Errorf("SamplesOf(%s %s) = %d, want %d", tc.path, tc.body, got, tc.want)
		}
	}
}

func TestBatchSizeStopsAtLimit(t *testing.T) {
	body := `{"text":[` + strings.Repeat(`"",`, 100000) + `""]}`
	if got := BatchSize(req("/generate", body), 11); got != 11 {
		t.Errorf("BatchSize with limit 11 = %d, want 11", got)
	}
	if got := BatchSize(req("/generate", body), 1<<20); got != 100001 {
		t.Errorf("BatchSize = %d, want 100001", got)
	}
	allocs := testing.AllocsPerRun(10, func() { BatchSize(req("/generate", body), 1<<20) })
	if allocs > 3 { // the Request view itself
		t.Errorf("BatchSize allocates %v times for a 100,001-prompt list", allocs)
	}
}

func TestConnectorFor(t *testing.T) {
	port := 7000
	for _, tc := range []struct {
		w       config.Worker
		def     string
		mode    string
		id      string // engine id minted for rank 1 (pinned)
		address string
	}{
		{config.Worker{URL: "http://h:1", KVConnector: "NixlConnector"}, "", ModeNixl, "", ""},
		{config.Worker{URL: "http://h:1", Labels: map[string]string{"kv_connector": "MooncakeConnector", "kv_engine_id": "e"}}, "", ModeMooncake, "e", "http://h:8998"},
		{config.Worker{URL: "http://[::1]:1", KVConnector: "mooncake", KVEngineID: "e", BootstrapPort: &port, DPSize: 2}, "", ModeMooncake, "e_dp1", "http://[::1]:7000"},
		{config.Worker{URL: "http://h:1", KVConnector: "MooncakeConnector", KVEngineID: "e", Labels: map[string]string{"dp_size": "x"}}, "", ModeMooncake, "", "http://h:8998"},
		{config.Worker{URL: "http://h:1"}, "NixlConnector", ModeNixl, "", ""},
		{config.Worker{URL: "http://h:1", KVConnector: "LMCacheConnectorV1"}, "NixlConnector", ModePassthrough, "", ""},
	} {
		c := ConnectorFor(worker.New(tc.w), tc.def)
		if c.Mode != tc.mode || c.BootstrapAddr != tc.address || (tc.mode == ModeMooncake && c.engineID(1, true) != tc.id) {
			t.Errorf("%+v: got %+v (id %q)", tc.w, c, c.engineID(1, true))
		}
	}
	dp := ConnectorFor(worker.New(config.Worker{URL: "http://h", KVConnector: "MooncakeConnector", KVEngineID: "e", DPSize: 4}), "")
	if dp.engineID(2, false) != "" {
		t.Error("DP engine id minted without a pinned rank")
	}
}

func TestMooncakeParams(t *testing.T) {
	id := newTransferID()
	if !strings.HasPrefix(id, "xfer-") || len(id) != len("xfer-")+36 || id[5+14] != '7' {
		t.Errorf("transfer id %q is not xfer-<uuid v7>", id)
	}
	if got := string(mooncakePrefillTag("xfer-1")); got != `{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-1"}` {
		t.Errorf("prefill tag %s", got)
	}
	want := `{"do_remote_decode":false,"do_remote_prefill":true,"transfer_id":"xfer-1","remote_engine_id":"e_dp0","remote_bootstrap_addr":"http://h:8998"}`
	if got := string(mooncakeDecodeParams("xfer-1", "e_dp0", "http://h:8998")); got != want {
		t.Errorf("decode params %s", got)
	}
	if p, ok := harvest([]byte(`{"kv_transfer_params":null}`)); p != nil || ok {
		t.Errorf("null params harvested: %s %v", p, ok)
	}
	if p, ok := harvest([]byte(`{"a":1,"kv_transfer_params":{"do_remote_prefill":true,"x":[1]}}`)); !ok || string(p) != `{"do_remote_prefill":true,"x":[1]}` {
		t.Errorf("params harvested as %s %v", p, ok)
	}
	if p, ok := harvest([]byte(`{"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}`)); ok || p == nil {
		t.Errorf("the request's own tag echoed back was taken for a handoff: %s %v", p, ok)
	}
}

func TestFixUsage(t *testing.T) {
	pu := prefillUsage{prompt: 10, cached: 4, ok: true}
	chat := `{"id":"x","usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":9}},"z":1}`
	got := string(fixUsage([]byte(chat), pu))
	if got != `{"id":"x","usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":4}},"z":1}` {
		t.Errorf("chat usage %s", got)
	}
	resp := `{"type":"response.completed","response":{"usage":{"input_tokens":10,"input_tokens_details":{"cached_tokens":9},"output_tokens":3,"total_tokens":13}}}`
	var v struct {
		Response struct {
			Usage map[string]any `json:"usage"`
		} `json:"response"`
	}
	json.Unmarshal(fixUsage([]byte(resp), pu), &v)
	if v.Response.Usage["input_tokens_details"].(map[string]any)["cached_tokens"].(float64) != 4 || v.Response.Usage["total_tokens"].(float64) != 13 {
		t.Errorf("responses usage %v", v.Response.Usage)
	}
	ev := "event: response.completed\ndata: " + resp + "\n\n"
	if out := string(fixUsageEvent([]byte(ev), pu)); !strings.HasPrefix(out, "event: response.completed\ndata: ") || !strings.Contains(out, `"cached_tokens":4`) || !strings.HasSuffix(out, "\n\n") {
		t.Errorf("event %q", out)
	}
	if out := fixUsageEvent([]byte("data: {\"choices\":[]}\n\n"), pu); string(out) != "data: {\"choices\":[]}\n\n" {
		t.Errorf("event without usage changed: %q", out)
	}
}

func TestLogprobMerge(t *testing.T) {
	pre := prefillLogprobs([]byte(`{"meta_info":{"input_token_logprobs":[[null,1,null],[-0.5,2,null]]}}`))
	got := string(mergeBody([]byte(`{"text":"x","meta_info":{"input_token_logprobs":[[-0.1,3,null]],"k":1}}`), pre))
	if got != `{"text":"x","meta_info":{"input_token_logprobs":[[null,1,null],[-0.5,2,null],[-0.1,3,null]],"k":1}}` {
		t.Errorf("merged %s", got)
	}
	batchPre := prefillLogprobs([]byte("data: {\"index\":1,\"meta_info\":{\"input_token_logprobs\":[[null,7,null]]}}\n\ndata: {\"index\":0,\"meta_info\":{\"input_token_logprobs\":[[null,6,null]]}}\n\ndata: [DONE]\n\n"))
	ev := mergeEvent([]byte("data: {\"index\":1,\"meta_info\":{\"input_token_logprobs\":[]}}\n\n"), batchPre)
	if string(ev) != "data: {\"index\":1,\"meta_info\":{\"input_token_logprobs\":[[null,7,null]]}}\n\n" {
		t.Errorf("streamed batch merge %q", ev)
	}
	ev = mergeEvent([]byte("id: 7\r\nevent: chunk\r\ndata: {\"index\":0,\"meta_info\":{\"input_token_logprobs\":[]}}\r\n\r\n"), batchPre)
	if string(ev) != "id: 7\r\nevent: chunk\r\ndata: {\"index\":0,\"meta_info\":{\"input_token_logprobs\":[[null,6,null]]}}\r\n\r\n" {
		t.Errorf("an event's id:, event: lines or line ends were not kept: %q", ev)
	}
	if out := mergeEvent([]byte("data: [DONE]\n\n"), batchPre); string(out) != "data: [DONE]\n\n" {
		t.Errorf("[DONE] changed: %q", out)
	}
}

func TestRoomForAgreesWithTheRank(t *testing.T) {
	for dp := 1; dp <= 8; dp++ {
		for rank := 0; rank < dp; rank++ {
			for i := 0; i < 200; i++ {
				room := roomFor(rank, dp)
				if room > 1<<63-1 || (dp > 1 && room%uint64(dp) != uint64(rank)) {
					t.Fatalf("roomFor(%d, %d) = %d", rank, dp, room)
				}
			}
		}
	}
}
