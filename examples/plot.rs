//! Plots benchmark records:
//!
//! - training (`examples/bench.rs`, `benches/torch_sdpa.py`): TFLOP/s against sequence
//!   length, one PNG per (dtype, pass) with a panel per head dim and causal setting, a line
//!   per implementation;
//! - decode (`examples/bench_decode.rs`, `benches/torch_decode.py`): K/V GB/s against cache
//!   length, one PNG per GQA shape with a panel per batch size, a line per implementation
//!   and page size, and the device's copy bandwidth.
//!
//!     cargo run --release --example plot -- docs/benchmarks/h200.json --out docs/benchmarks
//!
//! Text is drawn with a TrueType font read at run time (`--font`, default DejaVu Sans from
//! Debian's `fonts-dejavu-core`).

use std::collections::BTreeSet;
use std::path::PathBuf;

use clap::Parser;
use plotters::prelude::*;
use serde_json::Value;

#[derive(Parser, Debug)]
#[command(about = "Plot flash-attention benchmark records")]
struct Args {
    /// JSON files of records (headers are skipped).
    inputs: Vec<PathBuf>,
    /// Folder for the PNGs.
    #[arg(long, default_value = ".")]
    out: PathBuf,
    /// TrueType font for the labels.
    #[arg(
        long,
        default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
    )]
    font: PathBuf,
}

struct Point {
    implementation: String,
    pass: String,
    dtype: String,
    d: u64,
    causal: bool,
    s: u64,
    tflops: f64,
}

fn points(args: &Args) -> Vec<Point> {
    let mut out = Vec::new();
    for path in &args.inputs {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let records: Vec<Value> = serde_json::from_str(&text).expect("a JSON array of records");
        for r in records {
            if r.get("header").is_some()
                || r.get("cache_len").is_some()
                || r["h"] != r["h_kv"]
                || r["s_q"] != r["s_kv"]
            {
                continue; // the plots compare plain self-attention shapes
            }
            out.push(Point {
                implementation: r["impl"].as_str().unwrap().into(),
                pass: r["pass"].as_str().unwrap().into(),
                dtype: r["dtype"].as_str().unwrap().into(),
                d: r["d"].as_u64().unwrap(),
                causal: r["causal"].as_bool().unwrap(),
                s: r["s_q"].as_u64().unwrap(),
                tflops: r["tflops"].as_f64().unwrap(),
            });
        }
    }
    out
}

const COLORS: [RGBColor; 9] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let font: &'static [u8] = Box::leak(std::fs::read(&args.font)?.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| "the font could not be loaded")?;
    plot_decode(&args)?;
    let points = points(&args);
    let impls: Vec<String> = points
        .iter()
        .map(|p| p.implementation.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let groups: BTreeSet<(String, String)> = points
        .iter()
        .map(|p| (p.dtype.clone(), p.pass.clone()))
        .collect();
    std::fs::create_dir_all(&args.out)?;
    for (dtype, pass) in groups {
        let mine: Vec<&Point> = points
            .iter()
            .filter(|p| p.dtype == dtype && p.pass == pass)
            .collect();
        let dims: Vec<u64> = mine
            .iter()
            .map(|p| p.d)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let path = args.out.join(format!("{dtype}_{pass}.png"));
        let root = BitMapBackend::new(&path, (1200, 450 * dims.len() as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(
            &format!("{dtype} {pass}: TFLOP/s against sequence length"),
            ("sans-serif", 28),
        )?;
        let panels = root.split_evenly((dims.len(), 2));
        for (i, panel) in panels.iter().enumerate() {
            let (d, causal) = (dims[i / 2], i % 2 == 1);
            let here: Vec<&&Point> = mine
                .iter()
                .filter(|p| p.d == d && p.causal == causal)
                .collect();
            let series: Vec<(String, Vec<(f64, f64)>)> = impls
                .iter()
                .map(|imp| {
                    let line = here
                        .iter()
                        .filter(|p| &p.implementation == imp)
                        .map(|p| (p.s as f64, p.tflops))
                        .collect();
                    (imp.clone(), line)
                })
                .collect();
            draw_panel(
                panel,
                &format!("d = {d}, causal = {causal}"),
                ("sequence length", "TFLOP/s"),
                &series,
                None,
            )?;
        }
        root.present()?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// One panel: a line per series of `(x, y)` points, `x` on a log₂ axis, and an optional
/// horizontal ceiling.
fn draw_panel(
    panel: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    caption: &str,
    (x_desc, y_desc): (&str, &str),
    series: &[(String, Vec<(f64, f64)>)],
    ceiling: Option<(&str, f64)>,
) -> Result<(), Box<dyn std::error::Error>> {
    let xs = || series.iter().flat_map(|(_, l)| l.iter().map(|p| p.0));
    let max_x = xs().fold(2.0, f64::max);
    let min_x = xs().fold(f64::INFINITY, f64::min).min(max_x / 2.0);
    let max_y = series
        .iter()
        .flat_map(|(_, l)| l.iter().map(|p| p.1))
        .chain(ceiling.map(|c| c.1))
        .fold(1.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(panel)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((min_x.log2() - 0.2)..(max_x.log2() + 0.2), 0.0..max_y)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{}", 2f64.powf(x.round()) as u64))
        .x_labels(((max_x / min_x).log2() as usize + 1).max(2))
        .label_style(("sans-serif", 16))
        .draw()?;
    for (n, (name, line)) in series.iter().enumerate() {
        if line.is_empty() {
            continue;
        }
        let mut line: Vec<(f64, f64)> = line.iter().map(|&(x, y)| (x.log2(), y)).collect();
        line.sort_by(|a, b| a.0.total_cmp(&b.0));
        let color = COLORS[n % COLORS.len()];
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(line.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    if let Some((name, y)) = ceiling {
        let ends = vec![(min_x.log2() - 0.2, y), (max_x.log2() + 0.2, y)];
        chart
            .draw_series(LineSeries::new(ends, BLACK.stroke_width(1)))?
            .label(name)
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(1)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()?;
    Ok(())
}

/// The decode records of `args`' files: a PNG per GQA shape, a panel per batch size, a line
/// per implementation and page size, and the copy bandwidth of the files' headers.
fn plot_decode(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut records = Vec::new();
    let mut ceiling = None;
    for path in &args.inputs {
        let text = std::fs::read_to_string(path)?;
        for r in serde_json::from_str::<Vec<Value>>(&text)? {
            if r.get("header").is_some() {
                ceiling = r["ceiling_copy_gbps"].as_f64().or(ceiling);
            } else if r.get("cache_len").is_some() {
                records.push(r);
            }
        }
    }
    let key = |r: &Value, k: &str| r[k].as_u64().unwrap_or(0);
    let shapes: BTreeSet<(u64, u64)> = records
        .iter()
        .map(|r| (key(r, "h_q"), key(r, "h_kv")))
        .collect();
    for (h_q, h_kv) in shapes {
        let mine: Vec<&Value> = records
            .iter()
            .filter(|r| key(r, "h_q") == h_q && key(r, "h_kv") == h_kv)
            .collect();
        let batches: Vec<u64> = mine
            .iter()
            .map(|r| key(r, "b"))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let path = args.out.join(format!("decode_{h_q}x{h_kv}.png"));
        let root =
            BitMapBackend::new(&path, (1200, 450 * batches.len() as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(
            &format!("decode, GQA {h_q}:{h_kv}: K/V GB/s against cache length"),
            ("sans-serif", 28),
        )?;
        for (panel, &b) in root.split_evenly((batches.len(), 1)).iter().zip(&batches) {
            let mut lines: std::collections::BTreeMap<String, Vec<(f64, f64)>> = Default::default();
            for r in mine.iter().filter(|r| key(r, "b") == b) {
                let name = match key(r, "page_size") {
                    0 => r["impl"].as_str().unwrap_or("?").to_string(),
                    page => format!("{} pages of {page}", r["impl"].as_str().unwrap_or("?")),
                };
                let point = (
                    key(r, "cache_len") as f64,
                    r["kv_gbps"].as_f64().unwrap_or(0.0),
                );
                lines.entry(name).or_default().push(point);
            }
            let series: Vec<(String, Vec<(f64, f64)>)> = lines.into_iter().collect();
            draw_panel(
                panel,
                &format!("batch {b}"),
                ("cache length", "GB/s of K and V"),
                &series,
                ceiling.map(|c| ("device copy", c)),
            )?;
        }
        root.present()?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
