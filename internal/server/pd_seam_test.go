package server

// The PD seam's outcomes through the HTTP door: requests that must not be handed off, handoffs
// that must not be claimed, pairs that must agree (connector, runtime, DP rank), against
// simulators as strict as the engines.

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// A prompt list is a batch: vLLM answers only the first prompt's kv_transfer_params, and a
// decode serving the whole list with them fails. The prefill is skipped, visibly (none-batch),
// and the answer is the aggregated engine's.
func TestPDSequentialPromptListIsNotHandedOff(t *testing.T) {
	t.Parallel()
	for _, connector := range []string{"NixlConnector", "MooncakeConnector"} {
		t.Run(connector, func(t *testing.T) {
			t.Parallel()
			p, d, s, gw := vllmPD(t, connector, sim.Config{}, sim.Config{}, nil)
			agg := pdSim(t, sim.Config{Engine: sim.EngineVLLM})
			for _, body := range []string{
				`{"model":"m","prompt":["first of two","second of two"],"max_tokens":4}`,
				`{"model":"m","prompt":[[11,12,13],[21,22]],"max_tokens":4}`,
			} {
				_, want := gwtest.PostTimeout(t, agg.URL()+"/v1/completions", body)
				resp, got := gwtest.PostTimeout(t, gw+"/v1/completions", body)
				if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-batch" {
					t.Fatalf("%s: %d, handoff %q: %s", body, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), got)
				}
				if gwtest.StripIDs(got) != gwtest.StripIDs(want) {
					t.Errorf("PD answer\n%s\nwant (aggregated)\n%s", got, want)
				}
			}
			if st := p.Stats(); st.RequestsReceived != 0 {
				t.Errorf("the prefill served %d requests: a batch must not waste one", st.RequestsReceived)
			}
			if st := d.Stats(); st.KVLoadFailures != 0 {
				t.Errorf("%d decode KV loads failed", st.KVLoadFailures)
			}
			label := map[string]string{"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}[connector]
			if v := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("none-batch", pd.HandoffClass("none-batch"), label)); v != 2 {
				t.Errorf("none-batch counted %v, want 2", v)
			}
		})
	}
}

// kv_transfer_params that are the request's own tag echoed back (do_remote_decode still true)
// are no handoff: relaying them would ask the decode engine to prefill for a remote decode.
func TestPDSequentialEchoedTagIsNoHandoff(t *testing.T) {
	t.Parallel()
	echo := vllmFake(t, "NixlConnector", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		tag := b[strings.Index(string(b), `"kv_transfer_params":`)+len(`"kv_transfer_params":`):]
		tag = tag[:strings.IndexByte(string(tag), '}')+1]
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"x"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"kv_transfer_params":`+string(tag)+`}`)
	})
	d := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	_, gw, _ := gateway(t, nil, noRetries, pdFleet(t, echo, vllm(d.URL(), "m")))
	resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"echo echo","max_tokens":3}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-invalid-params" {
		t.Fatalf("%d, handoff %q: %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), body)
	}
	if src := resp.Header.Get(sim.HeaderKVSource); src != sim.SourceRecompute {
		t.Errorf("decode KV source %q, want recompute", src)
	}
}

// Every outcome is true: a failed PD request never says it handed off, a prefill that failed is
// never counted as a success, and a failed request still names its handoff (none-failed).
func TestPDOutcomesAreTrue(t *testing.T) {
	t.Parallel()
	t.Run("sglang prefill fails", func(t *testing.T) {
		t.Parallel()
		_, _, s, gw := sglangPD(t, sim.Config{Faults: sim.Faults{Status: 503}}, sim.Config{})
		resp, body := gwtest.PostTimeout(t, gw+"/generate", `{"text":"fail me","sampling_params":{"max_new_tokens":2}}`)
		if resp.StatusCode != 503 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-failed" {
			t.Fatalf("%d, handoff %q: %s", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), body)
		}
		poll.Until(t, "none-failed counted", func() bool {
			return testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("none-failed", pd.HandoffClass("none-failed"), "bootstrap")) == 1
		})
		if v := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("bootstrap", pd.HandoffClass("bootstrap"), "bootstrap")); v != 0 {
			t.Errorf("a failed request counted as %v bootstrap handoffs", v)
		}
	})
	t.Run("prefill fails after the decode answered", func(t *testing.T) {
		t.Parallel()
		release := make(chan struct{})
		prefill := engine(t, func(w http.ResponseWriter, r *http.Request) {
			io.ReadAll(r.Body)
			<-release
			w.WriteHeader(400)
			io.WriteString(w, `{"error":{"message":"bad"}}`)
		})
		decode := engine(t, func(w http.ResponseWriter, r *http.Request) {
			io.ReadAll(r.Body)
			io.WriteString(w, `{"text":"computed without the prefill"}`)
		})
		s, gw, _ := gateway(t, nil, noRetries, pdFleet(t, config.Worker{URL: prefill, Runtime: config.RuntimeSGLang}, config.Worker{URL: decode, Runtime: config.RuntimeSGLang}))
		resp, _ := gwtest.PostTimeout(t, gw+"/generate", `{"text":"late failure"}`)
		close(release)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		poll.Until(t, "prefill_failed counted", func() bool {
			return testutil.ToFloat64(s.metrics.PDRequests.WithLabelValues("none", "parallel", "prefill_failed")) == 1
		})
		if v := testutil.ToFloat64(s.metrics.PDRequests.WithLabelValues("none", "parallel", "success")); v != 0 {
			t.Errorf("a request whose prefill answered 400 counted as %v successes", v)
		}
	})
	for _, leg := range []string{"prefill", "decode"} {
		t.Run("vllm "+leg+" fails", func(t *testing.T) {
			t.Parallel()
			var pc, dc sim.Config
			if leg == "prefill" {
				pc.Faults.Status = 503
			} else {
				dc.Faults.Status = 503
			}
			_, _, s, gw := vllmPD(t, "NixlConnector", pc, dc, nil)
			resp, _ := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"fail me","max_tokens":2}`)
			if resp.StatusCode != 503 || resp.Header.Get("X-Baton-Kv-Handoff") != "none-failed" {
				t.Fatalf("%d, handoff %q", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"))
			}
			if v := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("none-failed", pd.HandoffClass("none-failed"), "nixl")); v != 1 {
				t.Errorf("none-failed counted %v", v)
			}
			if v := testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("nixl", pd.HandoffClass("nixl"), "nixl")); v != 0 {
				t.Errorf("a handoff the decode never consumed counted %v times as nixl", v)
			}
		})
	}
}

// Decodes have a connector too. Over a fleet that mixes NIXL and Mooncake pairs on one model,
// every request is paired within its connector and hands off; round robin across them would send
// half the requests to a decode that cannot read the params (a silent recompute).
func TestPDPairsWithinAConnector(t *testing.T) {
	t.Parallel()
	var ws []config.Worker
	var decodes []*sim.Engine
	for _, c := range []struct{ sim, name string }{{sim.ConnectorNixl, "NixlConnector"}, {sim.ConnectorMooncake, "MooncakeConnector"}} {
		p := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: c.sim, EngineID: "p-" + c.sim})
		d := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: c.sim})
		decodes = append(decodes, d)
		pw := config.Worker{URL: p.URL(), Role: config.RolePrefill, Runtime: config.RuntimeVLLM, KVConnector: c.name, KVEngineID: "p-" + c.sim, Models: []string{"m"}}
		if bp := p.BootstrapPort(); bp != 0 {
			pw.BootstrapPort = &bp
		}
		ws = append(ws, pw, config.Worker{URL: d.URL(), Role: config.RoleDecode, Runtime: config.RuntimeVLLM, KVConnector: c.name, Models: []string{"m"}})
	}
	// Decodes are chosen at random: not in lockstep with the prefills' round robin.
	_, gw, _ := gateway(t, nil, noRetries, pdFleetOf(t, config.PolicyRoundRobin, config.PolicyRandom, ws...))
	for i := range 12 {
		resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"pair me `+strings.Repeat("x", i)+`","max_tokens":2}`)
		if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
			t.Fatalf("request %d: %d, handoff %q, KV %q: %s", i, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), body)
		}
	}
	for _, d := range decodes {
		if st := d.Stats(); st.KVConnectorMismatches != 0 {
			t.Errorf("a decode got %d handoffs of another connector", st.KVConnectorMismatches)
		}
	}
}

// SGLang-only routes go only to workers that serve them: in a fleet with SGLang and vLLM pairs on
// one model, /generate and the info routes would otherwise flap between 200 and 404; generation
// routes both runtimes serve pair within a runtime; a vLLM pair's /health_generate checks each
// leg's /health.
func TestSGLangRoutesSkipVLLMWorkers(t *testing.T) {
	t.Parallel()
	sp := pdSim(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill})
	sd := pdSim(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode})
	vp := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	vd := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	bp := sp.BootstrapPort()
	m := []string{"m"}
	_, gw, _ := gateway(t, nil, noRetries, pdFleetOf(t, config.PolicyRoundRobin, config.PolicyRandom,
		config.Worker{URL: vp.URL(), Role: config.RolePrefill, Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector", Models: m},
		config.Worker{URL: sp.URL(), Role: config.RolePrefill, Runtime: config.RuntimeSGLang, BootstrapPort: &bp, Models: m},
		config.Worker{URL: vd.URL(), Role: config.RoleDecode, Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector", Models: m},
		config.Worker{URL: sd.URL(), Role: config.RoleDecode, Runtime: config.RuntimeSGLang, Models: m}))
	for i := range 6 {
		resp, body := gwtest.PostTimeout(t, gw+"/generate", `{"text":"sglang only","sampling_params":{"max_new_tokens":2}}`)
		if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Prefill-Worker") != sp.URL() {
			t.Fatalf("/generate %d: %d via %s: %s", i, resp.StatusCode, resp.Header.Get("X-Baton-Prefill-Worker"), body)
		}
		info, err := http.Get(gw + "/get_server_info")
		if err != nil {
			t.Fatal(err)
		}
		info.Body.Close()
		if info.StatusCode != 200 {
			t.Fatalf("/get_server_info %d: %d", i, info.StatusCode)
		}
	}
	// A vLLM prefill's params never go to an SGLang decode, nor a bootstrap room to a vLLM decode.
	for i := range 8 {
		resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"runtime pairs `+strings.Repeat("v", i)+`","max_tokens":2}`)
		if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderKVSource) != sim.SourceRemote {
			t.Fatalf("completion %d: %d, handoff %q, KV %q: %s", i, resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource), body)
		}
	}
	_, _, _, vgw := vllmPD(t, "NixlConnector", sim.Config{}, sim.Config{}, nil)
	resp, err := http.Get(vgw + "/health_generate")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("/health_generate on a vLLM pair: %d %s", resp.StatusCode, b)
	}
}

// The prefill's DP rank and the bootstrap room agree (room % dp_size == rank): an SGLang prefill
// that follows the room refuses every request whose rank disagrees with a random room, about half
// of them. A batch too.
func TestPDParallelRoomFollowsTheRank(t *testing.T) {
	t.Parallel()
	_, _, _, gw := sglangPD(t, sim.Config{DPSize: 2}, sim.Config{DPSize: 2}, dpSizes(2, 2))
	for i := range 16 {
		resp, body := gwtest.PostTimeout(t, gw+"/generate", `{"text":"rank and room `+strings.Repeat("y", i)+`","sampling_params":{"max_new_tokens":2}}`)
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
	}
	resp, body := gwtest.PostTimeout(t, gw+"/generate", `{"text":["a","b","c"],"sampling_params":{"max_new_tokens":1}}`)
	if resp.StatusCode != 200 {
		t.Fatalf("a batch: %d %s", resp.StatusCode, body)
	}
}
