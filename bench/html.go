package bench

import (
	"fmt"
	"html/template"
	"io"
	"math"
	"slices"
	"strings"
)

// The HTML report is one file with inline CSS and SVG: no script and no
// network fetch, so it reads the same offline.

type xy struct{ x, y float64 }

type vline struct {
	x     float64
	label string
}

type series struct {
	name string
	pts  []xy
}

var palette = []string{"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"}

// The page is pageW pixels wide at most and every chart fills it.
const (
	pageW          = 1400.0
	chartW, chartH = pageW - 32, 380.0 // the body's padding
	padL, padR     = 64.0, 230.0
	padT, padB     = 28.0, 44.0
)

// niceMax rounds v up to a round number: 1, 1.2, 1.6, 2, 2.4, 3, 4, 5, 6
// or 8 times a power of ten (each divisible into four ticks).
func niceMax(v float64) float64 {
	if !(v > 0) {
		return 1
	}
	e := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 1.2, 1.6, 2, 2.4, 3, 4, 5, 6, 8, 10} {
		if m*e >= v {
			return m * e
		}
	}
	return 10 * e
}

// lineChart draws series as lines with dots; mark, when set, is circled
// and labelled (the knee).
// vlines, when set, draws dashed vertical lines (load point starts).
func lineChart(title, xlabel, ylabel string, ss []series, mark *xy, markLabel string, vlines ...vline) template.HTML {
	return drawLineChart(title, xlabel, ylabel, ss, mark, markLabel, false, vlines...)
}

// logLineChart is lineChart on a logarithmic x axis, for figures that span
// decades (latencies from milliseconds to seconds).
func logLineChart(title, xlabel, ylabel string, ss []series) template.HTML {
	return drawLineChart(title, xlabel, ylabel, ss, nil, "", true)
}

func drawLineChart(title, xlabel, ylabel string, ss []series, mark *xy, markLabel string, logX bool, vlines ...vline) template.HTML {
	var xmax, ymax float64
	xmin := math.Inf(1)
	for _, s := range ss {
		for _, p := range s.pts {
			xmax, ymax = max(xmax, p.x), max(ymax, p.y)
			if p.x > 0 {
				xmin = min(xmin, p.x)
			}
		}
	}
	ymax = niceMax(ymax)
	pw, ph := chartW-padL-padR, chartH-padT-padB
	var X func(float64) float64
	var xticks []float64
	if logX {
		var lo, hi float64
		lo, hi, xticks = logScale(xmin, xmax)
		X = func(x float64) float64 {
			return padL + (math.Log10(max(x, lo))-math.Log10(lo))/(math.Log10(hi)-math.Log10(lo))*pw
		}
	} else {
		xmax = niceMax(xmax)
		X = func(x float64) float64 { return padL + x/xmax*pw }
		for i := 0; i <= 4; i++ {
			xticks = append(xticks, xmax*float64(i)/4)
		}
	}
	Y := func(y float64) float64 { return padT + ph - y/ymax*ph }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg viewBox="0 0 %g %g" width="%g" height="%g" role="img"><title>%s</title>`, chartW, chartH, chartW, chartH, template.HTMLEscapeString(title))
	fmt.Fprintf(&b, `<text x="%g" y="16" class="t">%s</text>`, padL, template.HTMLEscapeString(title))
	for i := 0; i <= 4; i++ {
		fy := ymax * float64(i) / 4
		fmt.Fprintf(&b, `<line x1="%g" x2="%g" y1="%g" y2="%g" class="g"/><text x="%g" y="%g" class="a" text-anchor="end">%s</text>`,
			padL, padL+pw, Y(fy), Y(fy), padL-4, Y(fy)+4, tick(fy))
	}
	for _, fx := range xticks {
		fmt.Fprintf(&b, `<text x="%.1f" y="%g" class="a" text-anchor="middle">%s</text>`, X(fx), padT+ph+16, tick(fx))
	}
	fmt.Fprintf(&b, `<text x="%g" y="%g" class="a" text-anchor="middle">%s</text>`, padL+pw/2, chartH-6, template.HTMLEscapeString(xlabel))
	fmt.Fprintf(&b, `<text transform="translate(14 %g) rotate(-90)" class="a" text-anchor="middle">%s</text>`, padT+ph/2, template.HTMLEscapeString(ylabel))
	for _, v := range vlines {
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%g" y2="%g" stroke="#999" stroke-dasharray="3 3"/><text x="%.1f" y="%g" class="a">%s</text>`,
			X(v.x), X(v.x), padT, padT+ph, X(v.x)+3, padT+10, template.HTMLEscapeString(v.label))
	}
	for i, s := range ss {
		c := palette[i%len(palette)]
		var pts []string
		for _, p := range s.pts {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", X(p.x), Y(p.y)))
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>`, c, strings.Join(pts, " "))
		if len(s.pts) <= 40 {
			for _, p := range s.pts {
				fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"/>`, X(p.x), Y(p.y), c)
			}
		}
		fmt.Fprintf(&b, `<rect x="%g" y="%g" width="10" height="10" fill="%s"/><text x="%g" y="%g" class="a">%s</text>`,
			padL+pw+10, padT+float64(i)*16, c, padL+pw+24, padT+float64(i)*16+9, template.HTMLEscapeString(s.name))
	}
	if mark != nil {
		fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="7" fill="none" stroke="#000" stroke-width="2"/><text x="%.1f" y="%.1f" class="a">%s</text>`,
			X(mark.x), Y(mark.y), X(mark.x)+9, Y(mark.y)-9, template.HTMLEscapeString(markLabel))
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String())
}

// barChart draws one bar per label.
func barChart(title, ylabel string, labels []string, values []float64) template.HTML {
	ymax := 0.0
	for _, v := range values {
		ymax = max(ymax, v)
	}
	ymax = niceMax(1.1 * ymax) // room for the value labels
	pw, ph := chartW-padL-padR, chartH-padT-padB
	Y := func(y float64) float64 { return padT + ph - y/ymax*ph }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg viewBox="0 0 %g %g" width="%g" height="%g" role="img"><title>%s</title>`, chartW, chartH, chartW, chartH, template.HTMLEscapeString(title))
	fmt.Fprintf(&b, `<text x="%g" y="16" class="t">%s</text>`, padL, template.HTMLEscapeString(title))
	for i := 0; i <= 4; i++ {
		fy := ymax * float64(i) / 4
		fmt.Fprintf(&b, `<line x1="%g" x2="%g" y1="%g" y2="%g" class="g"/><text x="%g" y="%g" class="a" text-anchor="end">%s</text>`,
			padL, padL+pw, Y(fy), Y(fy), padL-4, Y(fy)+4, tick(fy))
	}
	fmt.Fprintf(&b, `<text transform="translate(14 %g) rotate(-90)" class="a" text-anchor="middle">%s</text>`, padT+ph/2, template.HTMLEscapeString(ylabel))
	slot := pw / float64(max(1, len(values)))
	for i, v := range values {
		x := padL + float64(i)*slot + slot*0.15
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/><text x="%.1f" y="%g" class="a" text-anchor="middle">%s</text><text x="%.1f" y="%.1f" class="a" text-anchor="middle">%s</text>`,
			x, Y(v), slot*0.7, padT+ph-Y(v), palette[i%len(palette)], x+slot*0.35, padT+ph+16, template.HTMLEscapeString(labels[i]),
			x+slot*0.35, Y(v)-4, tick(v))
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String())
}

// tick writes an axis label with the digits it needs: a quarter of a
// round maximum may have one more than the maximum (22.5 of 90), which
// must not round to 22.
func tick(v float64) string {
	switch {
	case v == 0:
		return "0"
	case math.Abs(v) >= 1e6:
		return trimZeros(fmt.Sprintf("%.2f", v/1e6)) + "M"
	case math.Abs(v) >= 1e4:
		return trimZeros(fmt.Sprintf("%.2f", v/1e3)) + "k"
	case math.Abs(v) >= 10:
		return trimZeros(fmt.Sprintf("%.2f", v))
	}
	return fmt.Sprintf("%.3g", v)
}

// logScale returns the decades around [lo, hi] and a tick at each.
func logScale(lo, hi float64) (from, to float64, ticks []float64) {
	if !(lo > 0) || math.IsInf(lo, 0) {
		lo = 1
	}
	hi = max(hi, lo)
	from = math.Pow(10, math.Floor(math.Log10(lo)))
	to = math.Pow(10, math.Ceil(math.Log10(hi)))
	if to <= from {
		to = from * 10
	}
	for t := from; t <= to*1.0001; t *= 10 {
		ticks = append(ticks, t)
	}
	return from, to, ticks
}

// cdf returns the empirical CDF of values (in place sorted), thinned to at
// most 400 points.
func cdf(v []float64) []xy {
	slices.Sort(v)
	step := max(1, len(v)/400)
	var pts []xy
	for i := 0; i < len(v); i += step {
		pts = append(pts, xy{v[i], float64(i+1) / float64(len(v))})
	}
	if n := len(v); n > 0 && pts[len(pts)-1].y < 1 {
		pts = append(pts, xy{v[n-1], 1})
	}
	return pts
}

type htmlData struct {
	PageW  float64
	R      *Report
	Md     template.HTML
	Charts []template.HTML
}

var htmlTmpl = template.Must(template.New("report").Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvgate bench: {{.R.ModelID}}</title>
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:{{.PageW}}px;color:#222;padding:0 16px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
svg{display:block;margin:1.5em 0;width:100%;height:auto}
svg .g{stroke:#e4e4e4}svg .a{font-size:11px;fill:#444}svg .t{font-size:13px;font-weight:600}
code{background:#f3f3f3;padding:0 3px}
</style></head><body>
{{.Md}}
<h2>Charts</h2>
{{range .Charts}}{{.}}
{{end}}
</body></html>
`))

// WriteHTML writes one self-contained HTML page: the Markdown summary's
// tables, then latency against throughput with the knee marked, latency
// CDFs, the scraped KV usage and queue time series, and per-tenant bars.
func (r *Report) WriteHTML(w io.Writer) error {
	var md strings.Builder
	if err := r.WriteMarkdown(&md); err != nil {
		return err
	}
	d := htmlData{PageW: pageW, R: r, Md: markdownToHTML(md.String())}

	// Latency against throughput, one point per load point.
	pts := sortedByRate(r.LoadPoints)
	slices.SortStableFunc(pts, func(a, b LoadPoint) int {
		switch {
		case a.Summary.RequestThroughput < b.Summary.RequestThroughput:
			return -1
		case a.Summary.RequestThroughput > b.Summary.RequestThroughput:
			return 1
		}
		return 0
	})
	var ttft, e2el series
	ttft.name, e2el.name = "p99 TTFT", "median E2EL"
	var mark *xy
	for _, p := range pts {
		x := p.Summary.RequestThroughput
		ttft.pts = append(ttft.pts, xy{x, p.Summary.TTFT.Percentiles[99]})
		e2el.pts = append(e2el.pts, xy{x, p.Summary.E2EL.Median})
		if p.Index == r.Knee {
			mark = &xy{x, p.Summary.E2EL.Median}
		}
	}
	d.Charts = append(d.Charts, lineChart("Latency against throughput", "requests/s achieved", "ms", []series{ttft, e2el}, mark, "knee"))

	// Throughput and goodput against the offered rate, for sweeps.
	var tput, good series
	tput.name, good.name = "requests/s", "goodput requests/s"
	var kneeAt *xy
	for _, p := range sortedByRate(r.LoadPoints) {
		if math.IsInf(float64(p.RequestRate), 1) {
			continue
		}
		x := float64(p.RequestRate)
		tput.pts = append(tput.pts, xy{x, p.Summary.RequestThroughput})
		good.pts = append(good.pts, xy{x, p.Summary.RequestGoodput})
		if p.Index == r.Knee {
			kneeAt = &xy{x, p.Summary.RequestThroughput}
		}
	}
	if len(tput.pts) > 1 {
		d.Charts = append(d.Charts, lineChart("Throughput and goodput against offered load", "requests/s offered", "requests/s", []series{tput, good}, kneeAt, "knee"))
	}

	// CDFs of the headline point.
	var t, e, it []float64
	for _, q := range r.Requests {
		if q.Point != r.Headline || q.ErrorClass != "" {
			continue
		}
		e = append(e, ms(q.E2EL))
		if q.TTFT > 0 {
			t = append(t, ms(q.TTFT))
		}
		for _, g := range q.ITLs {
			it = append(it, ms(g))
		}
	}
	var cdfs []series
	for _, s := range []series{{"TTFT", cdf(t)}, {"E2EL", cdf(e)}, {"ITL", cdf(it)}} {
		if len(s.pts) > 0 {
			cdfs = append(cdfs, s)
		}
	}
	if len(cdfs) > 0 {
		// TTFT and ITL are often tens of ms where E2EL is seconds: a log
		// axis shows every curve's shape.
		d.Charts = append(d.Charts, logLineChart("Latency CDFs (headline load point)", "ms (log scale)", "fraction of requests", cdfs))
	}

	// Time series per scraped endpoint, with the load points' starts.
	sources := map[string]bool{}
	for _, smp := range r.TimeSeries {
		sources[smp.Source] = true
	}
	var starts []vline
	if len(r.LoadPoints) > 1 {
		for _, p := range r.LoadPoints {
			starts = append(starts, vline{p.Start, fmt.Sprintf("point %d", p.Index)})
		}
	}
	for _, group := range []struct {
		title, unit string
		names       []string
	}{
		{"KV cache usage", "fraction", []string{"kv_usage"}},
		{"Queue depth, running and waiting", "requests", []string{"queue_depth", "waiting", "running", "inflight"}},
		{"Preemptions (cumulative)", "preemptions", []string{"preemptions_total"}},
		{"GPU utilization", "fraction", []string{"gpu_utilization"}},
		{"GPU power", "watts", []string{"gpu_power_watts"}},
	} {
		var ss []series
		for _, name := range group.names {
			bySrc := map[string]*series{}
			var order []string
			for _, smp := range r.TimeSeries {
				v, ok := smp.Values[name]
				if !ok {
					continue
				}
				s := bySrc[smp.Source]
				if s == nil {
					s = &series{name: name}
					if len(sources) > 1 {
						s.name += " " + shortURL(smp.Source)
					}
					bySrc[smp.Source] = s
					order = append(order, smp.Source)
				}
				s.pts = append(s.pts, xy{smp.T, v})
			}
			for _, src := range order {
				ss = append(ss, *bySrc[src])
			}
		}
		if len(ss) > 0 {
			d.Charts = append(d.Charts, lineChart(group.title, "seconds from the start", group.unit, ss, nil, "", starts...))
		}
	}

	// Tenants.
	if len(r.Tenants) > 1 {
		var names []string
		var tput, p99 []float64
		for _, t := range r.Tenants {
			names = append(names, t.Name)
			tput = append(tput, t.Summary.OutputThroughput)
			p99 = append(p99, t.Summary.TTFT.Percentiles[99])
		}
		d.Charts = append(d.Charts, barChart(fmt.Sprintf("Output tokens/s per tenant (Jain's index %.3f)", r.JainIndex), "tokens/s", names, tput))
		d.Charts = append(d.Charts, barChart("p99 TTFT per tenant", "ms", names, p99))
	}
	return htmlTmpl.Execute(w, d)
}

func shortURL(u string) string {
	u = strings.TrimPrefix(strings.TrimPrefix(u, "http://"), "https://")
	return strings.TrimSuffix(u, "/metrics")
}

// markdownToHTML renders the small Markdown subset WriteMarkdown writes:
// headings, bullet lines, pipe tables and `code`.
func markdownToHTML(md string) template.HTML {
	var b strings.Builder
	inList, inTable := false, false
	closeAll := func() {
		if inList {
			b.WriteString("</ul>\n")
			inList = false
		}
		if inTable {
			b.WriteString("</table>\n")
			inTable = false
		}
	}
	inline := func(s string) string {
		s = template.HTMLEscapeString(s)
		parts := strings.Split(s, "`")
		for i := 1; i < len(parts); i += 2 {
			parts[i] = "<code>" + parts[i] + "</code>"
		}
		return strings.Join(parts, "")
	}
	for _, line := range strings.Split(md, "\n") {
		switch {
		case strings.HasPrefix(line, "## "):
			closeAll()
			fmt.Fprintf(&b, "<h2>%s</h2>\n", inline(line[3:]))
		case strings.HasPrefix(line, "# "):
			closeAll()
			fmt.Fprintf(&b, "<h1>%s</h1>\n", inline(line[2:]))
		case strings.HasPrefix(line, "- "):
			if !inList {
				closeAll()
				b.WriteString("<ul>\n")
				inList = true
			}
			fmt.Fprintf(&b, "<li>%s</li>\n", inline(line[2:]))
		case strings.HasPrefix(line, "|"):
			cells := strings.Split(strings.Trim(line, "|"), "|")
			if strings.HasPrefix(strings.TrimSpace(cells[0]), "---") {
				continue
			}
			tag := "td"
			if !inTable {
				closeAll()
				b.WriteString("<table>\n")
				inTable = true
				tag = "th"
			}
			b.WriteString("<tr>")
			for _, c := range cells {
				fmt.Fprintf(&b, "<%s>%s</%s>", tag, inline(strings.TrimSpace(c)), tag)
			}
			b.WriteString("</tr>\n")
		default:
			closeAll()
			if strings.TrimSpace(line) != "" {
				fmt.Fprintf(&b, "<p>%s</p>\n", inline(line))
			}
		}
	}
	closeAll()
	return template.HTML(b.String())
}
