package app

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
)

// BenchmarkPDSequential measures vLLM PD through Baton (NIXL: prefill, harvest, decode) against
// the same two legs sent by the client itself in the same run.
func BenchmarkPDSequential(b *testing.B) {
	p, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl, Model: pdModel})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	d, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl, Model: pdModel})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	cfg := config.Default()
	cfg.PDDisaggregation = true
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector"}, {URL: d.URL(), Role: config.RoleDecode}}
	_, gw := startGateway(&testing.T{}, cfg)
	defer gw.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	send := func(url string, body []byte) []byte {
		resp, err := client.Post(url, "application/json", bytes.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		out, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			b.Fatalf("status %d: %s", resp.StatusCode, out)
		}
		return out
	}
	for _, stream := range []bool{false, true} {
		body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"a benchmark prompt of a few words"}],"max_tokens":8,"ignore_eos":true,"stream":%v}`, stream)
		probe := []byte(`{"model":"m","messages":[{"role":"user","content":"a benchmark prompt of a few words"}],"max_tokens":1,"ignore_eos":true,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}`)
		b.Run(fmt.Sprintf("direct/stream=%v", stream), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				pr := send(p.URL()+"/v1/chat/completions", probe)
				i := bytes.Index(pr, []byte(`"kv_transfer_params":`))
				j := bytes.LastIndexByte(pr, '}')
				params := pr[i+len(`"kv_transfer_params":`) : j]
				if k := bytes.Index(params, []byte(`},"`)); k >= 0 { // params object ends before the next key
					params = params[:k+1]
				}
				leg := append([]byte(body[:len(body)-1]+`,"kv_transfer_params":`), params...)
				send(d.URL()+"/v1/chat/completions", append(leg, '}'))
			}
		})
		b.Run(fmt.Sprintf("baton/stream=%v", stream), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				send(gw.URL+"/v1/chat/completions", []byte(body))
			}
		})
	}
}

// BenchmarkMooncakeDispatch compares time to first token for Mooncake's two legs sent at once
// (the decode waits for the KV) and one after the other, with a latency model on the
// simulators: 20 µs per prompt token of prefill, 2 ms per output token. ns/op is the time to
// the first byte of the streamed answer.
func BenchmarkMooncakeDispatch(b *testing.B) {
	for _, dispatch := range []string{"sequential", "concurrent"} {
		b.Run(dispatch, func(b *testing.B) {
			lat := sim.Config{Model: pdModel, PrefillPerToken: 20 * time.Microsecond, DecodePerToken: 2 * time.Millisecond}
			pc, dc := lat, lat
			pc.Engine, pc.Role, pc.KVConnector, pc.EngineID = sim.EngineVLLM, sim.RolePrefill, sim.ConnectorMooncake, "mc"
			dc.Engine, dc.Role, dc.KVConnector = sim.EngineVLLM, sim.RoleDecode, sim.ConnectorMooncake
			p, err := sim.Start(pc)
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			d, err := sim.Start(dc)
			if err != nil {
				b.Fatal(err)
			}
			defer d.Close()
			cfg := config.Default()
			cfg.PDDisaggregation = true
			cfg.PDMooncakeDispatch = dispatch
			bp := p.BootstrapPort()
			cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "MooncakeConnector", KVEngineID: "mc", BootstrapPort: &bp}, {URL: d.URL(), Role: config.RoleDecode}}
			_, gw := startGateway(&testing.T{}, cfg)
			defer gw.Close()
			prompt := bytes.Repeat([]byte("word "), 500)
			body := []byte(`{"model":"m","prompt":"` + string(prompt) + `","max_tokens":4,"ignore_eos":true,"stream":true}`)
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 8}}
			var ttft time.Duration
			for b.Loop() {
				start := time.Now()
				resp, err := client.Post(gw.URL+"/v1/completions", "application/json", bytes.NewReader(body))
				if err != nil {
					b.Fatal(err)
				}
				one := make([]byte, 1)
				if _, err := io.ReadFull(resp.Body, one); err != nil {
					b.Fatal(err)
				}
				ttft += time.Since(start)
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			b.ReportMetric(float64(ttft.Microseconds())/float64(b.N), "ttft-µs")
		})
	}
}
