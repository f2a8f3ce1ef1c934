package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/baton-llm/baton/internal/sim"
)

// attack is one hostile client (or broken worker) run against a fresh Baton process.
type attack struct {
	name string
	// fleet starts what Baton routes to and returns Baton's arguments and a cleanup.
	fleet func() (args []string, cleanup func(), err error)
	// run performs the attack on Baton at base and says how it ended.
	run func(ctx context.Context, c *http.Client, b *proc) string
	env []string // Baton's extra environment (NAME=value)
}

// hardening: scenario 7, the memory attacks of the hardening work, each against a fresh Baton
// process, reported as its peak resident memory (VmHWM). Run it against an older build with
// --binary to compare.
func (r *runner) hardening(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 7. Attacks: peak memory")
	fmt.Fprintln(r.out)
	fmt.Fprintln(r.out, "Each attack runs against a fresh Baton process; the figure is its peak resident memory (VmHWM from /proc) over the whole run, startup included. The outcome is what the attacker saw.")
	fmt.Fprintln(r.out)
	fmt.Fprintln(r.out, "| attack | outcome | peak RSS MiB |")
	fmt.Fprintln(r.out, "|---|---|---:|")
	all := append(attacks(r.o.Quick), hardening2Attacks(r.o.Quick)...)
	rows := make([]string, len(all))
	errs := make([]error, len(all))
	// Each attack has a Baton of its own, so a quick run (the harness check) runs them at once;
	// a full run one at a time, each process alone on the machine.
	par := 1
	if r.o.Quick {
		par = len(all)
	}
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	for i, a := range all {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			rows[i], errs[i] = r.attack(ctx, a)
		}()
	}
	wg.Wait()
	r.client.CloseIdleConnections()
	for i := range all {
		if errs[i] != nil {
			return errs[i]
		}
		fmt.Fprintln(r.out, rows[i])
	}
	fmt.Fprintln(r.out)
	return nil
}

// attack runs one attack against a fresh Baton and returns its report row.
func (r *runner) attack(ctx context.Context, a attack) (string, error) {
	b, cleanup, err := startAttacked(r.o.Binary, a)
	if err != nil {
		return "", fmt.Errorf("%s: %w", a.name, err)
	}
	defer cleanup()
	actx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	outcome := a.run(actx, r.client, b)
	cancel()
	peak := b.peakRSSBytes()
	b.stop()
	return fmt.Sprintf("| %s | %s | %.0f |", a.name, outcome, mib(peak)), nil
}

// startAttacked starts the attack's fleet and a Baton in front of it. A port the fleet chose
// free can be taken by another process before Baton binds it: that start is tried again.
func startAttacked(binary string, a attack) (*proc, func(), error) {
	for try := 0; ; try++ {
		args, cleanup, err := a.fleet()
		if err != nil {
			return nil, nil, err
		}
		b, err := startBatonEnv(binary, 1, a.env, args...)
		if err == nil {
			return b, cleanup, nil
		}
		cleanup()
		if try == 2 || !strings.Contains(err.Error(), "address already in use") {
			return nil, nil, err
		}
	}
}

func attacks(quick bool) []attack {
	scale := 1
	if quick {
		scale = 8 // smaller bodies: checks the attacks run, not for publishing
	}
	return []attack{
		{name: "idle gateway (baseline)", fleet: regularFleet, run: func(ctx context.Context, c *http.Client, b *proc) string {
			return "—"
		}},
		{name: "SGLang PD, `\"n\": 10000000` (71-byte body)", fleet: sglangFleet, run: func(ctx context.Context, c *http.Client, b *proc) string {
			return send(ctx, c, b.URL+"/v1/chat/completions", []byte(`{"model":"`+benchModel+`","messages":[{"role":"user","content":"hi"}],"n":10000000}`))
		}},
		{name: fmt.Sprintf("SGLang PD, /generate with %d empty prompts", 2_000_000/scale), fleet: sglangFleet, run: func(ctx context.Context, c *http.Client, b *proc) string {
			body := `{"model":"` + benchModel + `","text":[""` + strings.Repeat(`,""`, 2_000_000/scale-1) + `]}`
			return send(ctx, c, b.URL+"/generate", []byte(body))
		}},
		{name: "16 sockets claiming `Content-Length: 536870000`, 3 bytes sent", fleet: regularFleet, run: func(ctx context.Context, c *http.Client, b *proc) string {
			if quick {
				return contentLengthClaims(ctx, b, 1, 100*time.Millisecond)
			}
			return contentLengthClaims(ctx, b, 3, time.Second)
		}},
		{name: fmt.Sprintf("ten %d MiB model names, then one /metrics scrape", max(1, 10/scale)), fleet: regularFleet, run: func(ctx context.Context, c *http.Client, b *proc) string {
			name := strings.Repeat("x", max(1, 10/scale)<<20)
			for i := 0; i < 10; i++ {
				send(ctx, c, b.URL+"/v1/chat/completions", []byte(`{"model":"`+name+strconv.Itoa(i)+`"}`))
			}
			return scrapeSize(ctx, c, b)
		}},
		{name: fmt.Sprintf("vLLM PD, decode answers an endless JSON body (%d MiB)", 1024/scale), fleet: brokenDecodeFleet(1024/scale, false), run: func(ctx context.Context, c *http.Client, b *proc) string {
			return send(ctx, c, b.URL+"/v1/completions", []byte(`{"model":"`+benchModel+`","prompt":"hi"}`))
		}},
		{name: fmt.Sprintf("vLLM PD, decode streams one SSE event without end (%d MiB)", 1024/scale), fleet: brokenDecodeFleet(1024/scale, true), run: func(ctx context.Context, c *http.Client, b *proc) string {
			return send(ctx, c, b.URL+"/v1/completions", []byte(`{"model":"`+benchModel+`","prompt":"hi","stream":true}`))
		}},
	}
}

// send posts body and describes the answer: its status and error code, or how it broke.
func send(ctx context.Context, c *http.Client, url string, body []byte) string {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err.Error()
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return "no answer: " + shortErr(err)
	}
	defer resp.Body.Close()
	n, err := io.Copy(io.Discard, resp.Body)
	out := strconv.Itoa(resp.StatusCode)
	if code := resp.Header.Get("X-Baton-Error-Code"); code != "" {
		out += " " + code
	}
	if err != nil {
		return out + fmt.Sprintf(", broken after %d bytes", n)
	}
	return out + fmt.Sprintf(" (%s)", sizeWords(n))
}

func shortErr(err error) string {
	s := err.Error()
	if i := strings.LastIndex(s, ": "); i >= 0 {
		s = s[i+2:]
	}
	return s
}

func sizeWords(n int64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}

// contentLengthClaims opens 16 connections that each announce a 512 MB body and send 3 bytes,
// holds them and closes them, for some rounds, so that memory freed by one round is reused (and
// must be zeroed) by the next.
func contentLengthClaims(ctx context.Context, b *proc, rounds int, hold time.Duration) string {
	addr := strings.TrimPrefix(b.URL, "http://")
	for round := 0; round < rounds; round++ {
		var conns []net.Conn
		for i := 0; i < 16; i++ {
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				return err.Error()
			}
			conns = append(conns, conn)
			fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 536870000\r\n\r\n{\"m")
		}
		select {
		case <-ctx.Done():
		case <-time.After(hold):
		}
		for _, conn := range conns {
			conn.Close()
		}
	}
	return fmt.Sprintf("%d rounds: held %s, then closed", rounds, hold)
}

// scrapeSize scrapes Baton's /metrics and says how large it was.
func scrapeSize(ctx context.Context, c *http.Client, b *proc) string {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, b.MetricsURL, nil)
	resp, err := c.Do(req)
	if err != nil {
		return "/metrics did not answer: " + shortErr(err)
	}
	defer resp.Body.Close()
	n, _ := io.Copy(io.Discard, resp.Body)
	return "/metrics is " + sizeWords(n)
}

func regularFleet() ([]string, func(), error) {
	e, err := engine(sim.Config{Engine: sim.EngineVLLM})
	if err != nil {
		return nil, nil, err
	}
	return []string{"--worker-urls", e.URL()}, e.Close, nil
}

// sglangFleet is an SGLang prefill and decode that discard what they are sent and answer
// briefly: what the attack costs is Baton's alone (a simulator would pay for the batch too).
func sglangFleet() ([]string, func(), error) {
	var lns []net.Listener
	for i := 0; i < 2; i++ {
		ln, err := serve(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet {
				io.WriteString(w, `{"object":"list","data":[{"id":"`+benchModel+`","object":"model","owned_by":"sglang"}]}`)
				return
			}
			io.Copy(io.Discard, r.Body)
			io.WriteString(w, `{"text":"x"}`)
		})
		if err != nil {
			return nil, nil, err
		}
		lns = append(lns, ln)
	}
	return []string{"--pd-disaggregation", "--prefill", "http://" + lns[0].Addr().String(), "--decode", "http://" + lns[1].Addr().String()},
		func() { lns[0].Close(); lns[1].Close() }, nil
}

// brokenDecodeFleet is a vLLM NIXL pair whose prefill answers correctly (params and usage, so
// Baton rewrites the decode's usage) and whose decode sends mib MiB without ever ending its JSON
// body, or its one SSE event.
func brokenDecodeFleet(mib int, stream bool) func() ([]string, func(), error) {
	return func() ([]string, func(), error) {
		prefill, err := serve(func(w http.ResponseWriter, r *http.Request) {
			if models(w, r) {
				return
			}
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"choices":[{"index":0,"text":"x"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[1]}}`)
		})
		if err != nil {
			return nil, nil, err
		}
		decode, err := serve(func(w http.ResponseWriter, r *http.Request) {
			if models(w, r) {
				return
			}
			io.Copy(io.Discard, r.Body)
			if stream {
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, "data: ")
			} else {
				w.Header().Set("Content-Type", "application/json")
				io.WriteString(w, `{"usage":{"prompt_tokens":3},"pad":"`)
			}
			chunk := bytes.Repeat([]byte("x"), 1<<20)
			for i := 0; i < mib; i++ {
				if _, err := w.Write(chunk); err != nil {
					return
				}
			}
		})
		if err != nil {
			prefill.Close()
			return nil, nil, err
		}
		return []string{"--pd-disaggregation", "--prefill", "http://" + prefill.Addr().String(), "--decode", "http://" + decode.Addr().String(), "--kv-connector", "NixlConnector", "--disable-retries"},
			func() { prefill.Close(); decode.Close() }, nil
	}
}

// models answers the registration probe as a vLLM engine serving the bench model.
func models(w http.ResponseWriter, r *http.Request) bool {
	if r.Method != http.MethodGet {
		return false
	}
	if r.URL.Path == "/v1/models" {
		io.WriteString(w, `{"object":"list","data":[{"id":"`+benchModel+`","object":"model","owned_by":"vllm"}]}`)
	} else {
		io.WriteString(w, "{}")
	}
	return true
}

// serve runs h on a loopback listener until the listener is closed.
func serve(h http.HandlerFunc) (net.Listener, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	go http.Serve(ln, h)
	return ln, nil
}

// peakRSSBytes is the peak resident memory of the process so far.
func (p *proc) peakRSSBytes() int64 { return p.statusBytes("VmHWM:") }
